"""Typed configuration: pipelines, per-stage configs and their resolution from every input path."""

from vllm_omni.config.lora import OmniStageLoRAConfig
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.pipeline_registry import PipelineConfig, StageSpec, resolve_pipeline_config
from vllm_omni.config.stage_config import (
    ARStageConfig,
    BaseVllmOmniStageConfig,
    DiffusionStageConfig,
    GenerationStageConfig,
    LLMStageConfig,
    OmniStageCacheConfig,
    OmniStageLoadConfig,
)

__all__ = [
    "ARStageConfig",
    "BaseVllmOmniStageConfig",
    "DiffusionStageConfig",
    "GenerationStageConfig",
    "LLMStageConfig",
    "OmniStageCacheConfig",
    "OmniStageLoRAConfig",
    "OmniStageLoadConfig",
    "PipelineConfig",
    "StageSpec",
    "VllmOmniConfig",
    "resolve_pipeline_config",
]
