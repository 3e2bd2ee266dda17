"""Which stage option names each structured stage config owns.

Every map here is generated from vLLM's own config dataclasses intersected with
``vllm.engine.arg_utils.EngineArgs``, so a field vLLM adds to ``CacheConfig`` (say) is
owned by our cache concern the day vLLM ships it, with no table to maintain. The
diffusion options are likewise the fields of this project's ``OmniDiffusionConfig``
dataclass. The only hand-written names are the stage-level keys of this project and a
few EngineArgs fields that belong to no upstream concern dataclass.
"""

from __future__ import annotations

import dataclasses
from functools import cache

from vllm.config import CacheConfig, LoadConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig
from vllm.engine.arg_utils import EngineArgs

from vllm_omni.config.diffusion import OmniDiffusionConfig

STAGE_TYPES = ("llm_ar", "llm_generation", "diffusion")
LLM_STAGE_TYPES = ("llm_ar", "llm_generation")

# LoRAConfig field name -> EngineArgs field name, where the two differ.
LORA_FIELD_ALIASES: dict[str, str] = {"target_modules": "lora_target_modules"}

# Keys every stage entry may carry that are not engine options.
STAGE_META_KEYS = frozenset(
    {
        "model",
        "stage_type",
        "model_arch",
        "engine_input_source",
        "final_output",
        "devices",
        "replicas",
        "ray_resources",
        "max_restarts",
        "restart_backoff_s",
    }
)

# EngineArgs fields owned by the stage engine concern although no upstream concern dataclass declares them.
EXTRA_LLM_ENGINE_FIELDS = frozenset(
    {
        "kv_cache_dtype",
        "disable_log_stats",
        "compilation_config",
        "attention_backend",
        "limit_mm_per_prompt",
        "mm_processor_kwargs",
        "structured_outputs_config",
        "speculative_config",
        "scheduling_policy",
        "additional_config",
    }
)


def _diffusion_fields(**metadata) -> frozenset[str]:
    """Stage options of ``OmniDiffusionConfig``: its init fields except ``model`` (a stage-level
    key) and those marked ``option=False``, filtered by the given metadata values."""
    return frozenset(
        f.name
        for f in dataclasses.fields(OmniDiffusionConfig)
        if f.init
        and f.name != "model"
        and f.metadata.get("option", True)
        and all(f.metadata.get(k) == v for k, v in metadata.items())
    )


# Options of a diffusion stage (the user-settable fields of OmniDiffusionConfig), and the LoRA ones.
DIFFUSION_FIELDS = _diffusion_fields()
DIFFUSION_LORA_FIELDS = _diffusion_fields(concern="lora")


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@cache
def engine_arg_names() -> frozenset[str]:
    """All field names of vLLM's ``EngineArgs``."""
    return frozenset(_fields(EngineArgs))


def _upstream_engine_field_map(cls, aliases: dict[str, str] | None = None) -> dict[str, str]:
    """Map ``cls`` field name -> EngineArgs field name for the fields both declare.

    ``aliases`` renames fields whose EngineArgs name differs (LoRA's ``target_modules``).
    """
    aliases = aliases or {}
    names = engine_arg_names()
    out: dict[str, str] = {}
    for name in sorted(_fields(cls)):
        ea_name = aliases.get(name, name)
        if ea_name in names:
            out[name] = ea_name
    return out


@cache
def lora_engine_field_map() -> dict[str, str]:
    """``LoRAConfig`` field -> EngineArgs field (``target_modules`` -> ``lora_target_modules``)."""
    return _upstream_engine_field_map(LoRAConfig, LORA_FIELD_ALIASES)


@cache
def lora_engine_arg_names() -> frozenset[str]:
    """EngineArgs names that configure vLLM LoRA: ``enable_lora`` plus the generated map's values."""
    return frozenset({"enable_lora", *lora_engine_field_map().values()})


@cache
def concern_engine_fields() -> dict[str, frozenset[str]]:
    """Concern name -> the EngineArgs names it owns on an LLM stage."""
    return {
        "model": frozenset(_upstream_engine_field_map(ModelConfig).values()) - {"model"},
        "load": frozenset(_upstream_engine_field_map(LoadConfig).values()),
        "cache": frozenset(_upstream_engine_field_map(CacheConfig).values()),
        "scheduler": frozenset(_upstream_engine_field_map(SchedulerConfig).values()),
        "parallel": frozenset(_upstream_engine_field_map(ParallelConfig).values()),
        "lora": lora_engine_arg_names(),
        "engine": frozenset(EXTRA_LLM_ENGINE_FIELDS & engine_arg_names()),
    }


@cache
def llm_stage_owned_keys() -> frozenset[str]:
    """Every option name an LLM stage accepts (engine fields of all concerns)."""
    return frozenset().union(*concern_engine_fields().values())


def owned_keys(stage_type: str) -> frozenset[str]:
    """Option names (besides :data:`STAGE_META_KEYS`) a stage of ``stage_type`` accepts."""
    if stage_type == "diffusion":
        return DIFFUSION_FIELDS
    return llm_stage_owned_keys()
