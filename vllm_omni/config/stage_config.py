"""Structured per-stage configs: one typed object per stage of a pipeline.

A stage config keeps the resolved options of its stage (EngineArgs names for LLM
stages, ``OmniDiffusionConfig`` names for diffusion stages) and, built from them at
construction, the typed concern configs: for LLM stages those that subclass vLLM's own
(``OmniStageLoadConfig(LoadConfig)``, ``OmniStageCacheConfig(CacheConfig)``,
``OmniStageLoRAConfig(LoRAConfig)``), for diffusion stages one ``OmniDiffusionConfig``.
Construction therefore runs the validation of every option and fails with a
:class:`~vllm_omni.errors.ConfigError` naming the stage. Model, scheduler and parallel options are owned through
maps generated from ``ModelConfig``/``SchedulerConfig``/``ParallelConfig``; those
upstream classes need engine-time inputs (the loaded HF config, ``max_model_len``) and
are validated by vLLM's ``create_engine_config`` when the stage engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ConfigDict, ValidationError
from vllm.config import CacheConfig, LoadConfig
from vllm.config.utils import config

from vllm_omni.config.diffusion import OmniDiffusionConfig
from vllm_omni.config.fields import LLM_STAGE_TYPES, LORA_FIELD_ALIASES, STAGE_TYPES, concern_engine_fields
from vllm_omni.config.lora import OmniStageLoRAConfig
from vllm_omni.config.overrides import validation_problems
from vllm_omni.config.placement import check_device_count, check_replicas, parse_devices
from vllm_omni.config.supervision import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_RESTART_BACKOFF_S,
    check_max_restarts,
    check_restart_backoff_s,
)
from vllm_omni.errors import ConfigError


@config(config=ConfigDict(arbitrary_types_allowed=True))
class OmniStageLoadConfig(LoadConfig):
    """vLLM ``LoadConfig`` of one LLM stage (only its explicitly set fields reach EngineArgs)."""


@config(config=ConfigDict(arbitrary_types_allowed=True))
class OmniStageCacheConfig(CacheConfig):
    """vLLM ``CacheConfig`` of one LLM stage (only its explicitly set fields reach EngineArgs)."""


def _plain(value: Any) -> Any:
    """Normalise option values to plain builtins (torch dtypes become their names, tuples lists)."""
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
        ray_resources: Ray resources the stage's actor needs besides one CPU (``worker_backend="ray"``),
            e.g. ``{"node_a": 1}`` for a custom resource a node was started with.
        origins: option name -> the input that set it (``--stage-overrides``, ``deploy config
            'd.yaml', stages[0]``, ...); errors name it.
        devices: where the stage's workers run (``["cpu"]``, ``["cuda:1", "cuda:2"]``; a
            comma-separated string is accepted and split), ``None`` for wherever the backend puts
            them; split in order into one group of :meth:`parallel_size` devices per replica.
        replicas: copies of the stage that share its requests (``>= 1``).
        max_restarts: restart attempts its worker may get over the runtime's life (``mp`` /
            ``ray``; per replica); see :mod:`vllm_omni.config.supervision`.
        restart_backoff_s: seconds before the first restart attempt after a death (doubled per
            attempt that failed in a row).

    Raises:
        ConfigError: (on construction) an unknown stage type, a bad ``devices`` / ``replicas``
            value, or a device count other than parallel size x replicas (naming the inputs).
    """

    stage_id: int
    stage_type: str
    model: str | None = None
    model_arch: str | None = None
    engine_input_source: list[int] = field(default_factory=list)
    final_output: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    ray_resources: dict[str, float] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    devices: list[str] | None = None
    replicas: int = 1
    max_restarts: int = DEFAULT_MAX_RESTARTS
    restart_backoff_s: float = DEFAULT_RESTART_BACKOFF_S

    def __post_init__(self) -> None:
        if self.stage_type not in STAGE_TYPES:
            raise ConfigError(
                f"stage {self.stage_id}: unknown stage_type {self.stage_type!r}; allowed: {STAGE_TYPES}"
            )
        self.options = _plain(dict(self.options))
        checks = (
            ("devices", parse_devices),
            ("replicas", check_replicas),
            ("max_restarts", check_max_restarts),
            ("restart_backoff_s", check_restart_backoff_s),
        )
        for key, check in checks:
            try:
                setattr(self, key, check(getattr(self, key)))
            except ConfigError as exc:
                raise ConfigError(f"{self.where([key])}: {exc}", options=exc.options) from exc

    def parallel_size(self) -> tuple[int, str]:
        """``(devices one replica needs, how messages name that number)``; 1 unless a subclass says more."""
        return 1, "1 device"

    def _check_placement(self) -> None:
        """The device count against parallel size x replicas (subclasses call it once their
        parallel options are checked)."""
        if self.devices is None or self.devices == ["cpu"]:
            return
        parallel, name = self.parallel_size()
        try:
            check_device_count(self.devices, parallel, name, self.replicas)
        except ConfigError as exc:
            keys = ["devices", "replicas", *self._parallel_keys()]
            raise ConfigError(f"{self.where(keys)}: {exc}", options=exc.options) from exc

    def _parallel_keys(self) -> list[str]:
        return []

    @property
    def is_llm(self) -> bool:
        return self.stage_type in LLM_STAGE_TYPES

    @property
    def label(self) -> str:
        return f"Stage {self.stage_id} ({self.stage_type})"

    def where(self, keys: Any) -> str:
        """``<inputs that set keys>, stage N (type)``; just the stage label when none is known."""
        sources = list(dict.fromkeys(self.origins[k] for k in keys if k in self.origins))
        stage = f"stage {self.stage_id} ({self.stage_type})"
        return f"{' and '.join(sources)}, {stage}" if sources else self.label

    def option_error(self, keys: Any, exc: Exception, what: str) -> ConfigError:
        """A :class:`ConfigError` for ``exc`` raised while checking the options ``keys``: one
        ``<input>, stage N (type): <key>=<value>: <problem>`` per pydantic error, else
        ``<inputs>, stage N (type): <what> <keys>: <exc>``."""
        keys = sorted(keys)
        if isinstance(exc, ValidationError):
            lines = []
            for loc, _, text, value in validation_problems(exc):
                key = LORA_FIELD_ALIASES.get(str(loc[0]), str(loc[0])) if loc else None
                if key in self.options:
                    lines.append(f"{self.where([key])}: {key}={value!r}: {text}")
                else:
                    lines.append(f"{self.where(keys)}: {what} {keys}: {text}")
            return ConfigError("; ".join(lines), options=keys)
        named = [k for k in getattr(exc, "options", ()) if k in self.options] or keys
        return ConfigError(f"{self.where(named)}: {what} {named}: {exc}", options=named)


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
            raise ConfigError(
                f"{self.where(['enable_lora'])}: enable_lora must be true or false, got {enable!r}",
                options=("enable_lora",),
            )
        if enable:
            lora_keys = [k for k in self.options if k in concerns["lora"] and k != "enable_lora"]
            try:
                self.lora_config = OmniStageLoRAConfig.from_engine_options(self.options)
            except Exception as exc:  # pydantic.ValidationError or ValueError
                raise self.option_error(lora_keys, exc, "invalid LoRA option(s)") from exc
        self._check_placement()

    def _parallel_keys(self) -> list[str]:
        return ["tensor_parallel_size", "pipeline_parallel_size"]

    def parallel_size(self) -> tuple[int, str]:
        """``tensor_parallel_size x pipeline_parallel_size`` (vLLM's world size; 1 each by default).

        Raises:
            ConfigError: one of them is not an integer >= 1 (only checked when ``devices`` is set;
                otherwise vLLM checks them when the engine starts).
        """
        sizes = {k: self.options.get(k, 1) for k in self._parallel_keys()}
        for key, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"{self.where([key])}: {key} must be an integer >= 1, got {value!r}", options=(key,)
                )
        tp, pp = sizes.values()
        name = f"tensor_parallel_size ({tp})" + (f" x pipeline_parallel_size ({pp})" if pp > 1 else "")
        return tp * pp, name

    def _build(self, concern: str, cls, names: frozenset[str]):
        kwargs = {k: v for k, v in self.options.items() if k in names}
        try:
            return cls(**kwargs)
        except Exception as exc:
            raise self.option_error(kwargs, exc, f"invalid {concern} option(s)") from exc


@dataclass
class ARStageConfig(LLMStageConfig):
    """Autoregressive LLM stage (``llm_ar``): decodes tokens, e.g. a thinker or rewriter."""


@dataclass
class GenerationStageConfig(LLMStageConfig):
    """Generation LLM stage (``llm_generation``): e.g. a code2wav or talker decoder."""


@dataclass
class DiffusionStageConfig(BaseVllmOmniStageConfig):
    """A diffusion stage; ``options`` are the explicitly set ``OmniDiffusionConfig`` fields.

    ``diffusion_config`` is the typed view built from them at construction (defaults
    applied, every value checked); the model directory is checked when the stage starts
    (:meth:`OmniDiffusionConfig.with_model`). Diffusion stages do not take vLLM LoRA
    options: ``enable_lora`` is rejected at resolution; their LoRA options are the
    ``OmniDiffusionConfig`` fields ``lora_path``, ``lora_scale``, ``lora_backend``,
    ``max_loras``, ``max_cpu_loras`` and ``max_lora_rank``.

    Raises:
        ConfigError: ``"<stage label>: <key> must be ..."`` for an invalid option.
    """

    diffusion_config: OmniDiffusionConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            self.diffusion_config = OmniDiffusionConfig(**self.options)
        except ConfigError as exc:
            named = [k for k in exc.options if k in self.options]  # none known: the stage label alone
            raise ConfigError(f"{self.where(named)}: {exc}", options=exc.options) from exc
        except TypeError as exc:  # an option that is no OmniDiffusionConfig field
            raise self.option_error(self.options, exc, "invalid diffusion option(s)") from exc
        self._check_placement()
        self._check_device_option()

    def _parallel_keys(self) -> list[str]:
        return ["tensor_parallel_size"]

    def parallel_size(self) -> tuple[int, str]:
        """The diffusion ``tensor_parallel_size`` (ranks of the in-tree denoiser)."""
        tp = self.diffusion_config.tensor_parallel_size
        return tp, f"tensor_parallel_size ({tp})"

    def _check_device_option(self) -> None:
        """The ``device`` option must agree with ``devices`` (a worker sees its devices renumbered
        from ``cuda:0``, so it takes ``"cuda"``, not an index)."""
        device = self.diffusion_config.device
        if self.devices is None or device is None:
            return
        want = "cpu" if self.devices == ["cpu"] else "cuda"
        if device != want:
            raise ConfigError(
                f"{self.where(['device', 'devices'])}: device={device!r} does not fit devices={self.devices}: "
                f"with devices set, leave device unset or set it to {want!r}",
                options=("device", "devices"),
            )

    @property
    def lora_config(self) -> None:
        """Diffusion stages never carry a vLLM LoRAConfig."""
        return None


_STAGE_CLASSES: dict[str, type[BaseVllmOmniStageConfig]] = {
    "llm_ar": ARStageConfig,
    "llm_generation": GenerationStageConfig,
    "diffusion": DiffusionStageConfig,
}


def make_stage_config(**kwargs: Any) -> BaseVllmOmniStageConfig:
    """Construct the stage config class matching ``kwargs["stage_type"]``."""
    stage_type = kwargs.get("stage_type")
    if stage_type not in _STAGE_CLASSES:
        raise ConfigError(
            f"stage {kwargs.get('stage_id')}: unknown stage_type {stage_type!r}; allowed: {sorted(_STAGE_CLASSES)}"
        )
    return _STAGE_CLASSES[stage_type](**kwargs)
