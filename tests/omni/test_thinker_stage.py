"""The ``qwen2_5_omni_thinker_only`` pipeline on the tiny checkpoint: vLLM's thinker, greedy
tokens equal to transformers' thinker (text, and one audio clip through vLLM's multimodal path,
torchvision or not), a thinker adapter equal to peft, the adapter-binding rule (an adapter vLLM
would apply to nothing, or only partly, is refused before it reaches vLLM), and audio the encoder
cannot take refused naming the culprit while the stage keeps serving."""

from __future__ import annotations

import pytest
import torch
from omni_reference import (
    qwen2_5_omni_audio_inputs,
    qwen2_5_omni_image_inputs,
    sine_noise_clip,
    thinker_greedy,
    thinker_greedy_from,
)

from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.request import LoRARequest
from vllm_omni.models.torchvision_free import torchvision_available

PROMPTS = ["Once upon a time", "The weather today is"]
N = 8
MAX_PIXELS = {"max_pixels": 56 * 56 * 4}


@pytest.fixture(scope="module")
def thinker_omni(tiny_omni_assets):
    from vllm_omni import Omni

    stage = {"dtype": "float32", "enable_lora": True, "max_lora_rank": 8, "max_model_len": 256}
    # images too (the CPU default is audio only): small ones, so that the start-up profile stays cheap
    stage |= {"limit_mm_per_prompt": {"audio": 1, "image": 1, "video": 0}, "mm_processor_kwargs": MAX_PIXELS}
    overrides = {"0": stage}
    with Omni(
        str(tiny_omni_assets.model_dir), pipeline="qwen2_5_omni_thinker_only", stage_overrides=overrides
    ) as omni:
        yield omni


def _params():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def _prompt_ids(omni, text):
    return omni._orchestrator.runtimes[0].tokenizer.encode(text, add_special_tokens=False)


def test_thinker_runs_vllms_thinker_class(thinker_omni):
    from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerForConditionalGeneration

    from vllm_omni.models import qwen2_5_omni_thinker

    assert thinker_omni.stage_configs[0].model_arch == "OmniQwen2_5OmniThinkerForConditionalGeneration"
    ours = qwen2_5_omni_thinker.Qwen2_5OmniThinkerForConditionalGeneration
    if torchvision_available():
        assert ours is Qwen2_5OmniThinkerForConditionalGeneration
    else:  # vLLM's model; only its multimodal processor's info differs (no video processor)
        assert ours.__bases__ == (Qwen2_5OmniThinkerForConditionalGeneration,)
        assert ours.__name__ == Qwen2_5OmniThinkerForConditionalGeneration.__name__
        assert "forward" not in ours.__dict__ and "load_weights" not in ours.__dict__
        assert ours._processor_factory.info.__name__.endswith("WithoutTorchvision")


def test_thinker_greedy_tokens_equal_transformers(thinker_omni, tiny_omni_assets):
    outs = thinker_omni.generate(PROMPTS, _params(), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = _prompt_ids(thinker_omni, prompt)
        assert out.token_ids == thinker_greedy(tiny_omni_assets.model_dir, ids, N)


def test_thinker_adapter_equals_peft(thinker_omni, tiny_omni_assets):
    adapter = LoRARequest("thinker", 1, str(tiny_omni_assets.thinker_adapter))
    outs = thinker_omni.generate(PROMPTS, _params(), lora_request=adapter, use_tqdm=False)
    base = thinker_omni.generate(PROMPTS, _params(), use_tqdm=False)
    for prompt, out, plain in zip(PROMPTS, outs, base):
        ids = _prompt_ids(thinker_omni, prompt)
        assert out.token_ids == thinker_greedy(
            tiny_omni_assets.model_dir, ids, N, tiny_omni_assets.thinker_adapter
        )
        assert out.token_ids != plain.token_ids  # the adapter does change the output


def test_adapter_saved_from_the_thinker_alone_is_refused(thinker_omni, tiny_omni_assets):
    """Its keys (``base_model.model.model.layers...``) bind nothing in vLLM's thinker: vLLM would
    silently run the base model. peft on the thinker alone applies it: the refusal names the fix."""
    alone = tiny_omni_assets.thinker_alone_adapter
    ids = _prompt_ids(thinker_omni, PROMPTS[0])
    # the same weights as the full-layout adapter: peft gives the same tokens with either layout
    assert thinker_greedy(tiny_omni_assets.model_dir, ids, N, alone, layout="thinker") == thinker_greedy(
        tiny_omni_assets.model_dir, ids, N, tiny_omni_assets.thinker_adapter
    )
    with pytest.raises(InvalidAdapterError) as err:
        thinker_omni.generate(
            PROMPTS[0], _params(), lora_request=LoRARequest("alone", 2, str(alone)), use_tqdm=False
        )
    message = str(err.value)
    assert "'alone'" in message and "Stage 0 (llm_ar)" in message
    assert "base_model.model.model.layers.0." in message  # an example key
    assert "base_model.model.thinker.model.layers.0." in message  # the fix


def test_plain_q_v_adapter_hitting_the_encoders_is_refused(thinker_omni, tiny_omni_assets, tmp_path):
    """peft's ``["q_proj", "v_proj"]`` on the whole model also wraps the audio encoder's (and the
    talker's) projections; vLLM's thinker adapts its decoder only, so with audio input it would
    silently differ from peft. Such an adapter is refused, naming the layers vLLM leaves out."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5OmniForConditionalGeneration

    full = Qwen2_5OmniForConditionalGeneration.from_pretrained(
        tiny_omni_assets.model_dir, dtype=torch.float32
    )
    peft_model = get_peft_model(full, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    keys = [n for n, _ in peft_model.named_parameters() if ".lora_A." in n]
    assert any(".audio_tower." in k for k in keys) and any(".model.layers." in k for k in keys)
    peft_model.save_pretrained(tmp_path / "plain")
    with pytest.raises(
        InvalidAdapterError,
        match=r"thinker\.audio_tower\.layers\.0\.self_attn\.(q|v)_proj: a layer vLLM does not adapt",
    ):
        thinker_omni.generate(
            PROMPTS[0],
            _params(),
            lora_request=LoRARequest("plain", 3, str(tmp_path / "plain")),
            use_tqdm=False,
        )
    # the stage keeps serving
    (out,) = thinker_omni.generate(PROMPTS[0], _params(), use_tqdm=False)
    assert len(out.token_ids) == N


AUDIO_PROMPT = ("Listen:", " What is it?")


def _audio_prompt(clip, rate=16000, text=None):
    before, after = AUDIO_PROMPT
    text = text if text is not None else f"{before}<|audio_bos|><|AUDIO|><|audio_eos|>{after}"
    return {"prompt": text, "multi_modal_data": {"audio": (clip, rate)}}


@pytest.fixture(scope="module")
def audio_reference(tiny_omni_assets):
    """transformers' thinker on the 1 s clip: (input ids, greedy tokens)."""
    inputs = qwen2_5_omni_audio_inputs(tiny_omni_assets.model_dir, *AUDIO_PROMPT, sine_noise_clip())
    return inputs["input_ids"][0].tolist(), thinker_greedy_from(tiny_omni_assets.model_dir, inputs, N)


def test_audio_prompt_greedy_tokens_equal_transformers(thinker_omni, audio_reference):
    """One audio clip through vLLM's multimodal path (on a CPU install: the processor built
    without its video processor): the placeholders expand to transformers' input ids and the greedy
    tokens equal transformers' thinker fed the Whisper features of the same clip."""
    (out,) = thinker_omni.generate(_audio_prompt(sine_noise_clip()), _params(), use_tqdm=False)
    ids, tokens = audio_reference
    assert list(out.request_output.prompt_token_ids) == ids
    assert out.token_ids == tokens


BAD_AUDIO = [
    ("empty", lambda clip: (clip[:0], 16000), r"audio item 0: .*shape \(0,\)"),
    ("complex", lambda clip: (clip.astype("complex64"), 16000), r"audio item 0: .*real numbers.*complex64"),
    ("3-D", lambda clip: (clip.reshape(1, 2, -1), 16000), r"audio item 0: .*shape \(1, 2, 8000\)"),
    ("NaN", lambda clip: (clip * float("nan"), 16000), r"audio item 0: .*NaN"),
    ("text", lambda clip: ("clip.wav", 16000), r"audio item 0: expected an array of samples.*got str"),
    ("rate 0", lambda clip: (clip, 0), r"audio item 0: sample rate 0 is not a positive number"),
    ("too long", lambda clip: (clip.repeat(12), 16000), r"longer than the maximum model length of 256"),
]


@pytest.mark.skipif(
    torchvision_available(),
    reason="the audio checks and the video refusal are registered without torchvision only",
)
def test_bad_audio_is_refused_naming_the_culprit_and_the_stage_keeps_serving(thinker_omni, audio_reference):
    import importlib.util

    import numpy as np
    from vllm.exceptions import VLLMValidationError

    clip = sine_noise_clip()
    cases = list(BAD_AUDIO)
    if importlib.util.find_spec("torchaudio") is None:  # vLLM's resampler: not on the CPU install
        cases.append(("8 kHz", lambda c: (c, 8000), r"sample rate 8000 Hz: .*takes 16000 Hz.*torchaudio"))
    for _name, make, message in cases:
        clip_in, rate = make(clip)
        with pytest.raises(VLLMValidationError, match=message):
            thinker_omni.generate(_audio_prompt(clip_in, rate), _params(), use_tqdm=False)
    with pytest.raises(VLLMValidationError, match=r"audio item 0: the prompt has no <\|AUDIO\|> placeholder"):
        thinker_omni.generate(_audio_prompt(clip, text="no placeholder"), _params(), use_tqdm=False)
    video = {
        "prompt": "<|vision_bos|><|VIDEO|><|vision_eos|>",
        "multi_modal_data": {"video": np.zeros((2, 28, 28, 3))},
    }
    with pytest.raises(VLLMValidationError, match=r"video input needs torchvision.*not installed"):
        thinker_omni.generate(video, _params(), use_tqdm=False)
    # nothing lost: the same clip (refused above without its placeholder) still gives transformers' tokens
    (out,) = thinker_omni.generate(_audio_prompt(clip), _params(), use_tqdm=False)
    assert out.token_ids == audio_reference[1]


def test_image_prompt_greedy_tokens_equal_transformers(thinker_omni, tiny_omni_assets):
    """One image through vLLM's multimodal path (on a CPU install: transformers' PIL image processor):
    prompt ids and greedy tokens equal transformers' thinker fed ``Qwen2VLImageProcessorPil``'s pixels."""
    import numpy as np
    from PIL import Image

    image = Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8))
    inputs = qwen2_5_omni_image_inputs(tiny_omni_assets.model_dir, "Look:", " What?", image, **MAX_PIXELS)
    prompt = {
        "prompt": "Look:<|vision_bos|><|IMAGE|><|vision_eos|> What?",
        "multi_modal_data": {"image": image},
    }
    (out,) = thinker_omni.generate(prompt, _params(), use_tqdm=False)
    assert list(out.request_output.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert out.token_ids == thinker_greedy_from(tiny_omni_assets.model_dir, inputs, N)
