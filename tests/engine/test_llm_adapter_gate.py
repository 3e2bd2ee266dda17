"""The LLM adapter gate (issue 13, items 2 and 10).

Item 2: an adapter whose update is finite on disk but not representable in the engine's LoRA dtype
(``lora_alpha`` 1e300, float64 weights beyond float32, B x 1e30) is refused naming the adapter and
the module, and later requests of any kind still equal transformers+peft.

Item 10: with ``lora_target_modules`` set, the gate serves exactly the adapters raw ``vllm.LLM``
applies with the same option (packed names such as ``qkv_proj`` cover ``q_proj`` / ``v_proj``), and
refuses the ones vLLM would load but leave out.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm import SamplingParams
from vllm.config import LoRAConfig

from tests.engine.engine_process_probe import MIXED_PROMPTS, N_TOKENS, probe_result, run_probe
from tests.llm_reference import hf_greedy
from vllm_omni.engine.lora_validation import LLMAdapterValidator
from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.request import LoRARequest

pytestmark = pytest.mark.engine

ENGINE_OPTS = dict(max_model_len=256, dtype="float32", max_num_seqs=8)
PROMPT = MIXED_PROMPTS[0]


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)


def _ref(assets, name):
    adapter = None if name is None else getattr(assets, f"adapter_{name}")
    return hf_greedy(assets.model_dir, PROMPT, N_TOKENS, adapter)


def _variant(tmp_path, assets, name, weights=None, config=None):
    path = tmp_path / name
    shutil.copytree(assets.adapter_a, path, ignore=shutil.ignore_patterns(".complete", ".lock"))
    if weights is not None:
        tensors = load_file(path / "adapter_model.safetensors")
        save_file({k: weights(k, v) for k, v in tensors.items()}, path / "adapter_model.safetensors")
    if config is not None:
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg.update(config)
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    return str(path)


def _overflowing(tmp_path, assets):
    """label -> (adapter dir, message fragment)."""
    return {
        "alpha_1e300": (
            _variant(tmp_path, assets, "alpha", config={"lora_alpha": 1e300}),
            r"self_attn\.[qv]_proj: its scaling .* is not representable in torch\.float32",
        ),
        "f64_x1e300": (
            _variant(tmp_path, assets, "f64", weights=lambda k, v: v.double() * 1e300),
            "float64 values beyond the float32 range",
        ),
        "b_x1e30": (
            _variant(tmp_path, assets, "b30", weights=lambda k, v: v * 1e30 if "lora_B" in k else v),
            r"self_attn\.[qv]_proj: its update bound",
        ),
    }


def test_overflowing_adapters_are_refused_and_change_nothing(tiny_llm_assets, tmp_path):
    from vllm_omni import Omni

    with Omni(str(tiny_llm_assets.model_dir), enable_lora=True, max_lora_rank=16, **ENGINE_OPTS) as omni:
        a = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
        assert omni.generate(PROMPT, greedy(), lora_request=a)[0].token_ids == _ref(tiny_llm_assets, "a")
        loaded = omni.list_loras()
        for i, (label, (path, fragment)) in enumerate(_overflowing(tmp_path, tiny_llm_assets).items()):
            request = LoRARequest(label, 70 + i, path)
            with pytest.raises(InvalidAdapterError, match=fragment) as info:
                omni.generate(PROMPT, greedy(), lora_request=request)
            assert path in str(info.value)
            with pytest.raises(InvalidAdapterError, match=label):
                omni.add_lora(request)
        assert omni.list_loras() == loaded
        assert omni.generate(PROMPT, greedy())[0].token_ids == _ref(tiny_llm_assets, None)
        assert omni.generate(PROMPT, greedy(), lora_request=a)[0].token_ids == _ref(tiny_llm_assets, "a")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gate_checks_in_the_engine_dtype(tiny_llm_assets, tmp_path, dtype):
    """bf16 (what dtype auto gives on some CPUs) and fp16 engines: the same refusals, the same
    ordinary adapters served; B x 1e4 is finite everywhere but overflows only fp16."""
    validator = LLMAdapterValidator(
        "Stage 0 (llm_ar)", str(tiny_llm_assets.model_dir), LoRAConfig(max_lora_rank=16), compute_dtype=dtype
    )
    for i, (label, (path, _)) in enumerate(_overflowing(tmp_path, tiny_llm_assets).items()):
        with pytest.raises(InvalidAdapterError, match=label):
            validator.validate(LoRARequest(label, 70 + i, path))
    for i, name in enumerate(("a", "b")):
        validator.validate(LoRARequest(name, i + 1, str(getattr(tiny_llm_assets, f"adapter_{name}"))))
    b_x1e4 = _variant(tmp_path, tiny_llm_assets, "b1e4", weights=lambda k, v: v * 1e4 if "lora_B" in k else v)
    request = LoRARequest("b1e4", 90, b_x1e4)
    if dtype == torch.float16:
        with pytest.raises(InvalidAdapterError, match=r"torch\.float16"):
            validator.validate(request)
    else:
        validator.validate(request)


TARGET_OPTIONS = [["qkv_proj"], ["q_proj"], ["o_proj"]]


@pytest.fixture(scope="module")
def raw_vllm_verdicts(tiny_llm_assets):
    """What raw vLLM answers for adapter_a under each of TARGET_OPTIONS (one fresh process for all)."""
    proc = run_probe(
        "raw-targets", tiny_llm_assets.model_dir.parent, PROBE_TARGETS=json.dumps(TARGET_OPTIONS)
    )
    return probe_result(proc)["by_targets"]


@pytest.mark.parametrize("targets", TARGET_OPTIONS, ids=lambda t: "+".join(t))
def test_target_modules_verdict_equals_raw_vllm(tiny_llm_assets, raw_vllm_verdicts, targets):
    """adapter_a (q_proj + v_proj): served with the adapter applied exactly when raw vLLM applies it."""
    raw = raw_vllm_verdicts["+".join(targets)]
    with_adapter, base = _ref(tiny_llm_assets, "a"), _ref(tiny_llm_assets, None)
    vllm_applies = raw.get("outputs") == with_adapter
    # the three answers raw vLLM can give are told apart (else the comparison proves nothing)
    assert vllm_applies or "error" in raw or raw["outputs"] == base, raw
    from vllm_omni import Omni

    with Omni(
        str(tiny_llm_assets.model_dir),
        enable_lora=True,
        max_lora_rank=16,
        lora_target_modules=targets,
        **ENGINE_OPTS,
    ) as omni:
        a = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
        if vllm_applies:
            assert omni.generate(PROMPT, greedy(), lora_request=a)[0].token_ids == with_adapter
        else:
            with pytest.raises(InvalidAdapterError, match="not covered by the stage's lora_target_modules"):
                omni.generate(PROMPT, greedy(), lora_request=a)
        assert omni.generate(PROMPT, greedy())[0].token_ids == base


def test_a_truncated_weights_file_is_refused_naming_the_file_and_the_stage(tiny_llm_assets, tmp_path):
    """Issue 46: a truncated ``adapter_model.safetensors`` (a trainer's save cut short) is refused naming
    the adapter, the file itself (not only its folder) and the stage."""
    path = _variant(tmp_path, tiny_llm_assets, "cut")
    weights = tmp_path / "cut" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    lora_config = LoRAConfig(max_lora_rank=16)
    validator = LLMAdapterValidator("Stage 0 (llm_ar)", str(tiny_llm_assets.model_dir), lora_config)
    with pytest.raises(InvalidAdapterError) as info:
        validator.validate(LoRARequest("cut", 5, path))
    message = str(info.value)
    assert "Stage 0 (llm_ar)" in message and f"file {str(weights)!r}" in message and "'cut'" in message
    assert "not a readable safetensors file" in message
