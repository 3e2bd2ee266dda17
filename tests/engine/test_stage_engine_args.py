"""Projection of typed stage configs to vLLM EngineArgs, checked through vLLM's create_engine_config."""

from __future__ import annotations

import dataclasses

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
