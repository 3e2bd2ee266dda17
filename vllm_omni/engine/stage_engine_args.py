"""Projection of a typed LLM stage config back to vLLM ``EngineArgs``."""

from __future__ import annotations

from typing import Any

from vllm.engine.arg_utils import EngineArgs

from vllm_omni.config.fields import lora_engine_arg_names
from vllm_omni.config.lora import OmniStageLoRAConfig
from vllm_omni.config.stage_config import LLMStageConfig
from vllm_omni.errors import ConfigError


def project_stage_engine_kwargs(stage: LLMStageConfig) -> dict[str, Any]:
    """EngineArgs keyword arguments of one LLM stage.

    A stage without ``lora_config`` gets its non-LoRA options only (exactly what it would
    get had LoRA never been mentioned); a stage with one gets ``enable_lora=True`` plus
    the LoRA options that were set explicitly, through the generated field map.

    Raises:
        ConfigError: the stage has no model path.
    """
    if not stage.model:
        raise ConfigError(
            f"{stage.label}: no model path; pass model=... or set 'model' in the stage's deploy entry"
        )
    lora_names = lora_engine_arg_names()
    kwargs: dict[str, Any] = {k: v for k, v in stage.options.items() if k not in lora_names}
    if stage.lora_config is not None:
        kwargs.update(OmniStageLoRAConfig.project_engine_args(stage.options))
    kwargs["model"] = stage.model
    return kwargs


def project_stage_engine_args(stage: LLMStageConfig) -> EngineArgs:
    """``EngineArgs`` of one LLM stage (see :func:`project_stage_engine_kwargs`)."""
    return EngineArgs(**project_stage_engine_kwargs(stage))
