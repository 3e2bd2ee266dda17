"""Structured per-stage configs: one typed object per stage of a pipeline.

A stage config keeps the resolved options of its stage (EngineArgs names for LLM
stages, ``OmniDiffusionConfig`` names for diffusion stages) and, built from them at
construction, the typed concern configs that subclass vLLM's own
(``OmniStageLoadConfig(LoadConfig)``, ``OmniStageCacheConfig(CacheConfig)``,
``OmniStageLoRAConfig(LoRAConfig)``). Construction therefore runs vLLM's validation
and fails naming the stage. Model, scheduler and parallel options are owned through
maps generated from ``ModelConfig``/``SchedulerConfig``/``ParallelConfig``; those
upstream classes need engine-time inputs (the loaded HF config, ``max_model_len``) and
are validated by vLLM's ``create_engine_config`` when the stage engine starts.

Stage configs cross process boundaries as msgpack (``to_msgpack``/``from_msgpack``):
only the resolved options travel, and the typed concerns are rebuilt (and re-validated)
on the receiving side, so both sides hold equal objects.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import torch
from pydantic import ConfigDict
from vllm.config import CacheConfig, LoadConfig
from vllm.config.utils import config

from vllm_omni.config.fields import LLM_STAGE_TYPES, STAGE_TYPES, concern_engine_fields
from vllm_omni.config.lora import OmniStageLoRAConfig


@config(config=ConfigDict(arbitrary_types_allowed=True))
class OmniStageLoadConfig(LoadConfig):
    """vLLM ``LoadConfig`` of one LLM stage (only its explicitly set fields reach EngineArgs)."""


@config(config=ConfigDict(arbitrary_types_allowed=True))
class OmniStageCacheConfig(CacheConfig):
    """vLLM ``CacheConfig`` of one LLM stage (only its explicitly set fields reach EngineArgs)."""


def _plain(value: Any) -> Any:
    """Normalise option values to msgpack builtins (torch dtypes become their names)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass
class BaseVllmOmniStageConfig:
    """Common part of every stage config.

    Attributes:
        stage_id: position of the stage in the pipeline (0 = entry stage).
        stage_type: ``"llm_ar"``, ``"llm_generation"`` or ``"diffusion"``.
        model: model directory or hub id this stage loads.
        model_arch: model class the stage needs (checked when its engine starts).
        engine_input_source: ids of the stages whose outputs feed this one.
        final_output: whether this stage's output is returned to the caller.
        options: the resolved explicit options (engine/diffusion option names).
    """

    stage_id: int
    stage_type: str
    model: str | None = None
    model_arch: str | None = None
    engine_input_source: list[int] = field(default_factory=list)
    final_output: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    STAGE_TYPE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if self.stage_type not in STAGE_TYPES:
            raise ValueError(
                f"stage {self.stage_id}: unknown stage_type {self.stage_type!r}; allowed: {STAGE_TYPES}"
            )
        self.options = _plain(dict(self.options))

    @property
    def is_llm(self) -> bool:
        return self.stage_type in LLM_STAGE_TYPES

    @property
    def label(self) -> str:
        return f"Stage {self.stage_id} ({self.stage_type})"

    def to_msgpack(self) -> bytes:
        """Serialise to msgpack; only builtins travel."""
        payload = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return msgspec.msgpack.encode(payload)

    @staticmethod
    def from_msgpack(data: bytes) -> BaseVllmOmniStageConfig:
        """Rebuild (and re-validate) a stage config serialised by :meth:`to_msgpack`."""
        payload = msgspec.msgpack.decode(data)
        return make_stage_config(**payload)


@dataclass
class LLMStageConfig(BaseVllmOmniStageConfig):
    """An LLM stage (runs a vLLM engine).

    Typed concerns built from ``options`` at construction: ``load_config``,
    ``cache_config`` and ``lora_config`` (``None`` unless ``enable_lora`` is set; other
    LoRA options then have no effect, as in vLLM).
    """

    load_config: OmniStageLoadConfig = field(init=False, repr=False)
    cache_config: OmniStageCacheConfig = field(init=False, repr=False)
    lora_config: OmniStageLoRAConfig | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        super().__post_init__()
        concerns = concern_engine_fields()
        self.load_config = self._build("load", OmniStageLoadConfig, concerns["load"])
        self.cache_config = self._build("cache", OmniStageCacheConfig, concerns["cache"])
        self.lora_config = None
        enable = self.options.get("enable_lora")
        if enable is not None and not isinstance(enable, bool):
            # a string such as "false" is truthy and would silently turn LoRA on
            raise ValueError(f"{self.label}: enable_lora must be true or false, got {enable!r}")
        if enable:
            try:
                self.lora_config = OmniStageLoRAConfig.from_engine_options(self.options)
            except Exception as exc:  # pydantic.ValidationError or ValueError
                raise ValueError(f"{self.label}: invalid LoRA option(s): {exc}") from exc

    def _build(self, concern: str, cls, names: frozenset[str]):
        kwargs = {k: v for k, v in self.options.items() if k in names}
        try:
            return cls(**kwargs)
        except Exception as exc:
            raise ValueError(f"{self.label}: invalid {concern} option(s) {sorted(kwargs)}: {exc}") from exc

    def concern_options(self, concern: str) -> dict[str, Any]:
        """The explicitly set options of one concern (``model``, ``scheduler``, ``lora``, ...)."""
        names = concern_engine_fields()[concern]
        return {k: v for k, v in self.options.items() if k in names}


@dataclass
class ARStageConfig(LLMStageConfig):
    """Autoregressive LLM stage (``llm_ar``): decodes tokens, e.g. a thinker or rewriter."""


@dataclass
class GenerationStageConfig(LLMStageConfig):
    """Generation LLM stage (``llm_generation``): e.g. a code2wav or talker decoder."""


@dataclass
class DiffusionStageConfig(BaseVllmOmniStageConfig):
    """A diffusion stage; ``options`` are ``OmniDiffusionConfig`` fields.

    Diffusion stages do not take vLLM LoRA options: ``enable_lora`` is rejected at
    resolution. Their LoRA options are ``lora_path``, ``lora_scale``, ``lora_backend``,
    ``max_loras`` and ``max_cpu_loras``.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_diffusion_option_types(self.label, self.options)
        backend = self.options.get("lora_backend", "peft")
        if backend not in ("peft", "distill"):
            raise ValueError(f"{self.label}: lora_backend must be 'peft' or 'distill', got {backend!r}")
        if backend == "distill" and not self.options.get("lora_path"):
            raise ValueError(
                f"{self.label}: lora_backend='distill' needs lora_path (one or more .safetensors files)"
            )

    @property
    def lora_config(self) -> None:
        """Diffusion stages never carry a vLLM LoRAConfig."""
        return None


# Diffusion options that must be integers >= 1 (None allowed for the optional ones).
_DIFFUSION_POSITIVE_INTS = ("max_loras", "max_lora_rank", "max_batch_size", "tensor_parallel_size")
_DIFFUSION_BOOLS = ("enable_progress_bar", "enforce_eager")
_DIFFUSION_STRINGS = ("dtype", "device", "pipeline_backend", "lora_backend")


def _check_diffusion_option_types(label: str, options: dict[str, Any]) -> None:
    """Type checks of a diffusion stage's options, so that a bad value fails at resolution
    (``--dry-run`` included) naming the stage and option, not at engine start."""

    def bad(key: str, want: str) -> ValueError:
        value = options[key]
        return ValueError(f"{label}: {key} must be {want}, got {type(value).__name__}: {value!r}")

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for key in _DIFFUSION_POSITIVE_INTS:
        if key in options and not (is_int(options[key]) and options[key] >= 1):
            raise bad(key, ">= 1 (an integer)")
    if options.get("max_cpu_loras") is not None and not (
        is_int(options["max_cpu_loras"]) and options["max_cpu_loras"] >= 1
    ):
        raise bad("max_cpu_loras", ">= 1 (an integer, or unset)")
    if options.get("seed") is not None and not is_int(options["seed"]):
        raise bad("seed", "an integer (or unset)")
    if "lora_scale" in options:
        scale = options["lora_scale"]
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise bad("lora_scale", "a finite number")
    for key in _DIFFUSION_BOOLS:
        if key in options and not isinstance(options[key], bool):
            raise bad(key, "true or false")
    for key in _DIFFUSION_STRINGS:
        if options.get(key) is not None and not isinstance(options[key], str):
            raise bad(key, "a string")
    paths = options.get("lora_path")
    if paths is not None:
        items = [paths] if isinstance(paths, str) else paths
        if not isinstance(items, list) or not items or not all(isinstance(p, str) and p for p in items):
            raise bad("lora_path", "a path string or a non-empty list of path strings")


_STAGE_CLASSES: dict[str, type[BaseVllmOmniStageConfig]] = {
    "llm_ar": ARStageConfig,
    "llm_generation": GenerationStageConfig,
    "diffusion": DiffusionStageConfig,
}


def make_stage_config(**kwargs: Any) -> BaseVllmOmniStageConfig:
    """Construct the stage config class matching ``kwargs["stage_type"]``."""
    stage_type = kwargs.get("stage_type")
    if stage_type not in _STAGE_CLASSES:
        raise ValueError(
            f"stage {kwargs.get('stage_id')}: unknown stage_type {stage_type!r}; allowed: {sorted(_STAGE_CLASSES)}"
        )
    return _STAGE_CLASSES[stage_type](**kwargs)
