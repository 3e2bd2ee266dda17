"""Qwen3-Omni end to end: ``Omni(<folder>)`` picks ``qwen3_omni`` (MoE thinker on vLLM -> talker ->
code2wav on transformers); text, codes and waveform against transformers' ``generate(return_audio=True)``.

One pipeline serves the module; the reference runs once. Greedy thinker and talker on both sides
(transformers mirrors the talker's ``do_sample`` onto its code predictor), the thinker's stop at
``<|im_end|>`` on both sides.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import test_assets_root
from vllm import SamplingParams

from vllm_omni.errors import ConfigError, InvalidRequestError, LoRANotEnabledError
from vllm_omni.inputs.audio import AudioParams
from vllm_omni.lora.request import LoRARequest

THINK, TALK = 8, 16
TEXT = "Once upon a time"
#: the waveform's tolerance against transformers (float32, same code path; measured 0.0)
WAVE_ATOL = 1e-5


@pytest.fixture(scope="module")
def assets():
    from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets

    return ensure_tiny_qwen3_omni_assets(test_assets_root())


@pytest.fixture(scope="module")
def omni(assets):
    from vllm_omni import Omni

    stage = {"dtype": "float32", "max_model_len": 256, "enable_lora": True, "max_lora_rank": 16}
    with Omni(str(assets.model_dir), stage_overrides={"0": stage}) as engine:
        yield engine


def _chat(omni, text=TEXT) -> str:
    tokenizer = omni._orchestrator.runtimes[0].tokenizer
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def _params(voice="Ethan"):
    return [
        SamplingParams(temperature=0, max_tokens=THINK),
        SamplingParams(temperature=0, max_tokens=TALK),
        AudioParams(voice=voice),
    ]


@functools.cache
def reference(model_dir: str, prompt_ids: tuple[int, ...], eos: int, voice: str):
    """``(thinker tokens, talker codes [G, N], waveform)`` of transformers' Omni ``generate``."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    captured = {}
    decode = model.code2wav.chunked_decode

    def capture(codes, **kwargs):
        captured["codes"] = codes[0].clone()
        return decode(codes, **kwargs)

    model.code2wav.chunked_decode = capture
    ids = torch.tensor([prompt_ids])
    seq, wav = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        speaker=voice,
        thinker_max_new_tokens=THINK,
        thinker_eos_token_id=eos,
        talker_do_sample=False,
        talker_max_new_tokens=TALK,
    )
    return seq[0, ids.shape[1] :].tolist(), captured["codes"], wav.reshape(-1).numpy()


def test_folder_gets_thinker_talker_and_code2wav(omni):
    assert omni.config.pipeline.name == "qwen3_omni"
    assert [s.model_arch for s in omni.stage_configs] == [
        "OmniQwen3OmniMoeThinkerForConditionalGeneration",
        "OmniQwen3OmniMoeTalkerForConditionalGeneration",
        "OmniQwen3OmniMoeCode2Wav",
    ]
    kinds = [d.output_kind for d in omni._orchestrator.descriptions]
    assert kinds == ["text", "codec", "audio"]


def test_text_codes_and_waveform_equal_transformers(omni, assets):
    from vllm_omni.stages.qwen3_omni.code2wav import SAMPLE_RATE

    prompt = _chat(omni)
    text, audio = omni.generate(prompt, _params(), use_tqdm=False)
    tokenizer = omni._orchestrator.runtimes[0].tokenizer
    ids = tuple(tokenizer.encode(prompt, add_special_tokens=False))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens, codes, wav = reference(str(assets.model_dir), ids, eos, "Ethan")
    assert text.token_ids == tokens
    talker_codes = audio.stage_outputs[1].codes
    assert talker_codes.shape == codes.shape and talker_codes.shape[1] > 0
    assert torch.equal(talker_codes, codes)
    assert audio.sample_rate == SAMPLE_RATE and audio.audio.dtype == np.float32 and audio.audio.ndim == 1
    np.testing.assert_allclose(audio.audio, wav, rtol=0, atol=WAVE_ATOL)
    assert np.abs(wav).max() > 1e-3  # not a silent reference


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lora_request": {1: "talker"}}, LoRANotEnabledError, r"Stage 1 \(llm_ar\)"),
        ({"lora_request": {2: "talker"}}, LoRANotEnabledError, r"Stage 2 \(llm_generation\)"),
        ({"voice": "nobody"}, InvalidRequestError, "unknown voice 'nobody'"),
        ({"prompt": TEXT}, InvalidRequestError, r"Stage 1 .*no '<\|im_start\|>assistant' turn"),
    ],
)
def test_bad_requests_are_refused_naming_the_stage(omni, assets, kwargs, error, match):
    """An adapter for a stage without LoRA or an unknown voice is refused before the request
    starts; a prompt without the chat template's assistant turn is refused by the talker. The
    pipeline keeps serving."""
    lora = kwargs.get("lora_request")
    if lora is not None:
        lora = {stage: LoRARequest(name, 7, str(assets.thinker_adapter)) for stage, name in lora.items()}
    prompt = kwargs.get("prompt", _chat(omni))
    with pytest.raises(error, match=match):
        omni.generate(prompt, _params(kwargs.get("voice", "Ethan")), lora_request=lora, use_tqdm=False)
    text, audio = omni.generate(_chat(omni), _params(), use_tqdm=False)
    assert len(text.token_ids) == THINK and audio.audio.size > 0


def test_global_lora_options_are_refused_naming_the_llm_stages(assets):
    from vllm_omni.entrypoints.omni_base import build_omni_config

    with pytest.raises(ConfigError, match=r"qwen3_omni.*\[0, 1, 2\]"):
        build_omni_config(str(assets.model_dir), enable_lora=True)
