"""The ``qwen2_5_omni_thinker_only`` pipeline on the tiny checkpoint: vLLM's thinker, greedy
tokens equal to transformers' thinker, a thinker adapter equal to peft, and the adapter-binding
rule (an adapter vLLM would apply to nothing, or only partly, is refused before it reaches vLLM)."""

from __future__ import annotations

import pytest
import torch
from omni_reference import thinker_greedy

from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.request import LoRARequest

PROMPTS = ["Once upon a time", "The weather today is"]
N = 8


@pytest.fixture(scope="module")
def thinker_omni(tiny_omni_assets):
    from vllm_omni import Omni

    overrides = {"0": {"dtype": "float32", "enable_lora": True, "max_lora_rank": 8, "max_model_len": 256}}
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
    assert (
        qwen2_5_omni_thinker.Qwen2_5OmniThinkerForConditionalGeneration
        is Qwen2_5OmniThinkerForConditionalGeneration
    )


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
