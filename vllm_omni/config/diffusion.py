"""``OmniDiffusionConfig``: the typed options of a diffusion stage, validated in one place.

The option names a diffusion stage accepts are this dataclass's fields (see
:func:`vllm_omni.config.fields.diffusion_option_names`), as the LLM stages' names come from
vLLM's config dataclasses. Construction checks every option's type and range, so a
stage config resolved by ``VllmOmniConfig`` (``--dry-run`` included) fails on a bad value
before any engine starts. The model directory is checked only when ``model`` is given
(the engine does that with :meth:`OmniDiffusionConfig.with_model` when the stage starts).

This module lives under ``config/`` (not ``diffusion/``) so that configuration never imports
the diffusion runtime; ``vllm_omni.diffusion.data`` re-exports it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_omni.config.call_defaults import check_guidance, check_steps, model_index_defaults
from vllm_omni.config.dit_families import IN_TREE_PIPELINES, family_for_class
from vllm_omni.config.dit_family import check_variants
from vllm_omni.errors import ConfigError
from vllm_omni.lora.request import MAX_ADAPTER_SCALE

PIPELINE_BACKENDS = ("auto", "in_tree", "diffusers")
LORA_BACKENDS = ("peft", "distill")
#: How a diffusion stage batches requests (``OmniDiffusionConfig.batching``).
BATCHING_MODES = ("request", "step")
DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# Field metadata: ``concern`` groups the LoRA options; ``option=False`` marks runtime-internal
# fields that are not stage options (set only by code that builds the config directly).
_LORA = {"concern": "lora"}
_INTERNAL = {"option": False}

# Options that must be integers >= 1.
_POSITIVE_INTS = ("tensor_parallel_size", "max_batch_size", "max_loras", "max_lora_rank")
_BOOLS = ("enable_progress_bar", "keep_base_weights", "lora_merge", "compile_warm_up")
#: Devices whose diffusion stages compile their denoiser when ``enforce_eager`` is unset (see
#: ``OmniDiffusionConfig.compiles`` and docs/user_guide/diffusion_compile.md for the measurements).
COMPILE_BY_DEFAULT_ON = ("cuda",)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(key: str, value: Any, want: str) -> ConfigError:
    return ConfigError(f"{key} must be {want}, got {type(value).__name__}: {value!r}", options=(key,))


def is_known_pipeline_class(class_name: str | None) -> bool:
    """Whether ``class_name`` has an in-tree pipeline or is a ``diffusers`` pipeline class."""
    if class_name in IN_TREE_PIPELINES:
        return True
    # only here: the config package never imports diffusers (tests/config/test_diffusion_config.py;
    # measured: ~0.9 s CPU on top of vLLM and torch)
    import diffusers

    return bool(class_name) and hasattr(diffusers, str(class_name))


@dataclass
class OmniDiffusionConfig:
    """Settings of a diffusion stage (engine, runtime and LoRA options).

    Attributes:
        model: local diffusers-format directory holding ``model_index.json`` and one folder
            per component (no hub ids: nothing is downloaded); ``None`` for the options alone.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), a name from ``DTYPES`` or a torch dtype.
        tensor_parallel_size: ranks sharding the in-tree denoiser (``>= 1``); ``> 1`` runs
            one worker process per rank and needs the in-tree backend.
        device: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available). With TP each rank
            uses ``cuda:<rank>``.
        pipeline_backend: one of ``PIPELINE_BACKENDS``: ``"auto"`` (in-tree when ``_class_name``
            has one, else diffusers), ``"in_tree"`` or ``"diffusers"``.
        enable_progress_bar: report denoising progress: a tqdm bar when stderr is a terminal, else
            INFO log lines (``vllm_omni.diffusion.progress``).
        seed: default seed of requests that set none (``None``: a random one per request).
        default_num_inference_steps / default_guidance_scale: the steps (an integer in [1, 1000]) and
            guidance (a number in [0, 100]) of a request that sets none, over the model's own suggestion
            (``None``: the model's; :mod:`vllm_omni.config.call_defaults`, served as the ``/ui`` page's
            defaults).
        max_batch_size: prompts per denoiser batch of the stage runtime (``>= 1``); with
            ``batching="step"``, the most requests running at once.
        batching: one of ``BATCHING_MODES``: ``"request"`` (default: a batch of compatible requests runs
            from its first step to its last) or ``"step"`` (step-level batching: a request joins the
            running denoiser batch at the next step and leaves when done, each row with its own steps,
            guidance, seed and adapters; :mod:`vllm_omni.engine.diffusion_steps`). Pipelines without a
            per-step unit (the diffusers fallback) batch whole requests either way.
        enforce_eager: ``False`` compiles the denoiser's repeated blocks with ``torch.compile``
            (:mod:`vllm_omni.diffusion.compile`; LoRA then runs from fixed-shape banks and never
            recompiles), ``True`` runs eagerly, ``None`` (default) picks by device: compiled on CUDA,
            eager on CPU (there the first compile costs minutes for a ~10-20 % faster step).
        compile_cache_dir: inductor cache directory of a compiled stage (reused across restarts);
            ``None``: ``~/.cache/vllm_omni/torch_compile/<stage key>``.
        compile_warm_up: ``True`` (default): a compiled stage compiles every graph variant a request
            can need when it starts (:mod:`vllm_omni.diffusion.compile_warmup`: six short generations,
            adapters on and off; the stage's ready line says how long it took), so nothing compiles
            while serving; ``False`` opts out (graphs compile in the first requests that need them);
            ignored by an eager stage.
        compile_backend: the ``torch.compile`` backend of a compiled stage (vLLM's
            ``compilation_config.backend``): ``"inductor"`` (default: generated kernels, cached in
            ``compile_cache_dir``), or any registered dynamo backend such as ``"aot_eager"`` (traced
            graphs run by eager kernels: to tell an inductor fault from a tracing one) or ``"eager"``.
        keep_base_weights: (internal) keep dense base weights in ``layer.weight`` of vLLM
            linear layers on CPU instead of repacking (see ``finalize_linear_layers``).
        distributed_init_method: (internal) torch.distributed URL for TP workers; ``None``
            picks a temp file.
        lora_path: adapter directory/file (or list) to load at start-up; ``None`` for none.
        lora_scale: finite scale applied to ``lora_path`` adapters, at most ``MAX_ADAPTER_SCALE`` (100)
            in magnitude, the bound of a request's adapter scale.
        lora_backend: one of ``LORA_BACKENDS``: ``"peft"`` or ``"distill"`` (needs ``lora_path``).
        max_loras: adapters active at once (``>= 1``).
        max_cpu_loras: adapters cached on CPU; ``None`` means ``max_loras`` plus the number of
            start-up PEFT adapters (``lora_path``, which are pinned); must be ``>= max_loras``.
        max_lora_rank: largest LoRA rank the PEFT backend accepts (device buffers are sized for it).
        lora_merge: the merged fast path (``False`` by default): a batch whose every row uses one and
            the same adapter at one constant scale runs on base weights with the adapter folded in
            (no LoRA GEMMs per step); the base weights are restored bitwise before any other batch
            (another adapter or scale, mixed rows, none). Costs a copy of the adapted layers' weights
            while merged; pays when one adapter serves many steps (RL rollouts). See
            ``docs/user_guide/rl_rollouts.md``.

    Raises:
        ConfigError: (on construction) naming the field, the allowed values and the value
            given: a wrong type or range, an unknown backend/dtype/device, bad LoRA limits;
            with ``model``: a missing directory, ``model_index.json`` or component folder, an
            unknown pipeline class, ``pipeline_backend="in_tree"`` or TP ``> 1`` without an
            in-tree pipeline.
    """

    model: str | None = None
    dtype: str | torch.dtype = "auto"
    tensor_parallel_size: int = 1
    device: str | None = None
    pipeline_backend: str = "auto"
    enable_progress_bar: bool = True
    seed: int | None = None
    default_num_inference_steps: int | None = None
    default_guidance_scale: float | None = None
    max_batch_size: int = 8
    batching: str = "request"
    enforce_eager: bool | None = None
    compile_cache_dir: str | None = None
    compile_warm_up: bool = True
    compile_backend: str = "inductor"
    keep_base_weights: bool = field(default=True, metadata=_INTERNAL)
    distributed_init_method: str | None = field(default=None, metadata=_INTERNAL)
    lora_path: str | list[str] | None = field(default=None, metadata=_LORA)
    lora_scale: float = field(default=1.0, metadata=_LORA)
    lora_backend: str = field(default="peft", metadata=_LORA)
    max_loras: int = field(default=1, metadata=_LORA)
    max_cpu_loras: int | None = field(default=None, metadata=_LORA)
    max_lora_rank: int = field(default=64, metadata=_LORA)
    lora_merge: bool = field(default=False, metadata=_LORA)
    model_index: dict[str, Any] = field(default_factory=dict, repr=False, init=False, compare=False)

    def __post_init__(self) -> None:
        self._check_types()
        self._check_lora()
        if self.model is not None:
            self._check_model()

    def _check_compile_backend(self) -> None:
        """Raises ConfigError unless ``compile_backend`` names a registered dynamo backend."""
        if not (isinstance(self.compile_backend, str) and self.compile_backend):
            raise _bad("compile_backend", self.compile_backend, "a torch.compile backend name")
        from torch._dynamo import list_backends

        if self.compile_backend not in list_backends(exclude_tags=()):
            raise _bad(
                "compile_backend",
                self.compile_backend,
                "a registered dynamo backend: 'inductor', 'aot_eager', 'eager', ...",
            )

    def with_model(self, model: str | os.PathLike) -> OmniDiffusionConfig:
        """A copy bound to ``model`` (checked: directory, ``model_index.json``, pipeline class).

        Raises:
            ConfigError: see the class docstring.
        """
        return dataclasses.replace(self, model=os.fspath(model))

    # ------------------------------------------------------------------ validation
    def _check_types(self) -> None:
        for key in _POSITIVE_INTS:
            value = getattr(self, key)
            if not (_is_int(value) and value >= 1):
                raise _bad(key, value, ">= 1 (an integer)")
        if self.max_cpu_loras is not None and not (_is_int(self.max_cpu_loras) and self.max_cpu_loras >= 1):
            raise _bad("max_cpu_loras", self.max_cpu_loras, ">= 1 (an integer, or unset)")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", self.seed, "an integer (or unset)")
        self._check_call_defaults()
        for key in _BOOLS:
            if not isinstance(getattr(self, key), bool):
                raise _bad(key, getattr(self, key), "true or false")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise _bad("enforce_eager", self.enforce_eager, "true or false (or unset: by device)")
        if self.compile_cache_dir is not None and not (
            isinstance(self.compile_cache_dir, str) and self.compile_cache_dir
        ):
            raise _bad("compile_cache_dir", self.compile_cache_dir, "a directory path (or unset)")
        if self.compile_backend != "inductor":
            self._check_compile_backend()
        if not isinstance(self.dtype, str | torch.dtype):
            raise _bad("dtype", self.dtype, "a string or a torch.dtype")
        if isinstance(self.dtype, str) and self.dtype not in DTYPES:
            raise ConfigError(
                f"dtype must be a torch.dtype or one of {list(DTYPES)}, got {self.dtype!r}",
                options=("dtype",),
            )
        if self.device is not None and (
            not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda")
        ):
            raise ConfigError(
                f"device must be 'cpu', 'cuda' or None, got {self.device!r}", options=("device",)
            )
        if self.batching not in BATCHING_MODES:
            raise ConfigError(
                f"batching must be one of {list(BATCHING_MODES)}, got {self.batching!r}",
                options=("batching",),
            )
        if self.pipeline_backend not in PIPELINE_BACKENDS:
            raise ConfigError(
                f"pipeline_backend must be one of {list(PIPELINE_BACKENDS)}, got {self.pipeline_backend!r}",
                options=("pipeline_backend",),
            )
        scale = self.lora_scale
        if (
            isinstance(scale, bool)
            or not isinstance(scale, int | float)
            or not math.isfinite(scale)
            or abs(scale) > MAX_ADAPTER_SCALE
        ):
            # one set of limits: a request's adapter scale obeys the same bound
            raise _bad(
                "lora_scale", scale, f"a finite number in [-{MAX_ADAPTER_SCALE:g}, {MAX_ADAPTER_SCALE:g}]"
            )
        paths = self.lora_path
        items = [paths] if isinstance(paths, str) else paths
        if paths is not None and (
            not isinstance(items, list) or not items or not all(isinstance(p, str) and p for p in items)
        ):
            raise _bad("lora_path", paths, "a path string or a non-empty list of path strings (or unset)")

    def _check_call_defaults(self) -> None:
        for key, check in (
            ("default_num_inference_steps", check_steps),
            ("default_guidance_scale", check_guidance),
        ):
            value = getattr(self, key)
            if value is None:
                continue
            try:
                check(value, key)
            except ConfigError as exc:
                raise ConfigError(f"{exc} (or unset: the model's)", options=(key,)) from None

    def _check_lora(self) -> None:
        if self.lora_backend not in LORA_BACKENDS:
            raise ConfigError(
                f"lora_backend must be one of {list(LORA_BACKENDS)}, got {self.lora_backend!r}",
                options=("lora_backend",),
            )
        if self.lora_backend == "distill" and not self.startup_lora_paths:
            raise ConfigError(
                "lora_backend='distill' needs lora_path (one or more .safetensors files)",
                options=("lora_backend", "lora_path"),
            )
        if self.lora_backend == "distill" and not self.keep_base_weights:
            raise ConfigError(
                "lora_backend='distill' fuses into the dense base weights and needs keep_base_weights=True",
                options=("lora_backend", "keep_base_weights"),
            )
        startup = len(self.startup_lora_paths) if self.lora_backend == "peft" else 0
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras + startup
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
                options=("max_cpu_loras", "max_loras"),
            )
        if startup and self.max_cpu_loras < startup:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) is smaller than the {startup} start-up adapter(s) of "
                f"lora_path, which are pinned in the cache; raise max_cpu_loras",
                options=("max_cpu_loras", "lora_path"),
            )

    def _check_model(self) -> None:
        if not isinstance(self.model, str | os.PathLike):
            raise _bad("model", self.model, "a diffusers directory path")
        self.model = os.fspath(self.model)
        root = Path(self.model)
        if not root.is_dir():
            raise ConfigError(f"model must be a local diffusers directory; {self.model!r} is not a directory")
        index_path = root / "model_index.json"
        if not index_path.is_file():
            raise ConfigError(f"model directory {self.model!r} has no model_index.json")
        self.model_index = json.loads(index_path.read_text())
        model_index_defaults(self.model_index, self.model)  # a bad "_call_defaults" fails at start
        missing = [name for name, spec in self.components.items() if spec and not (root / name).is_dir()]
        if missing:
            raise ConfigError(f"model directory {self.model!r} lacks component folders {missing}")
        in_tree = list(IN_TREE_PIPELINES)
        if self.pipeline_backend == "in_tree" and self.class_name not in IN_TREE_PIPELINES:
            raise ConfigError(
                f"unknown pipeline class {self.class_name!r} for pipeline_backend='in_tree'; "
                f"in-tree pipelines: {in_tree}"
            )
        if not self.use_in_tree and not is_known_pipeline_class(self.class_name):
            raise ConfigError(
                f"unknown pipeline class {self.class_name!r}: neither an in-tree pipeline {in_tree} "
                f"nor a diffusers pipeline class"
            )
        family = family_for_class(self.class_name) if self.use_in_tree else None
        if family is not None:  # a variant the family does not serve fails here, naming folder, key, value
            check_variants(family, root)
        if self.tensor_parallel_size > 1 and not self.use_in_tree:
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs an in-tree pipeline "
                f"(pipeline_backend 'auto' or 'in_tree' with _class_name in {in_tree}); "
                f"got {self.class_name!r} with pipeline_backend={self.pipeline_backend!r}"
            )

    # ------------------------------------------------------------------ derived values
    @property
    def startup_lora_paths(self) -> list[str]:
        """``lora_path`` as a list (empty when unset)."""
        if self.lora_path is None:
            return []
        return [self.lora_path] if isinstance(self.lora_path, str) else list(self.lora_path)

    @property
    def class_name(self) -> str:
        """``_class_name`` of ``model_index.json`` (e.g. ``"ZImagePipeline"``)."""
        return str(self.model_index.get("_class_name"))

    @property
    def components(self) -> dict[str, tuple[str, str] | None]:
        """Component name -> ``(library, class)``, ``None`` for components stored as ``[null, null]``."""
        out: dict[str, tuple[str, str] | None] = {}
        for key, value in self.model_index.items():
            if not key.startswith("_") and isinstance(value, list) and len(value) == 2:
                out[key] = None if None in value else (value[0], value[1])
        return out

    @property
    def use_in_tree(self) -> bool:
        """Whether the engine runs the in-tree pipeline for this directory (``"auto"``: whenever
        ``_class_name`` has one; every layout of those classes runs in-tree)."""
        if self.pipeline_backend == "diffusers":
            return False
        return self.class_name in IN_TREE_PIPELINES

    def resolved_device(self) -> str:
        """``device`` or, when ``None``, ``"cuda"`` if available else ``"cpu"``."""
        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def compiles(self) -> bool:
        """Whether the stage compiles its denoiser: ``not enforce_eager``, or by device when unset
        (``COMPILE_BY_DEFAULT_ON``)."""
        if self.enforce_eager is not None:
            return not self.enforce_eager
        return self.resolved_device().split(":")[0] in COMPILE_BY_DEFAULT_ON

    def torch_dtype(self) -> torch.dtype:
        """The concrete torch dtype (``"auto"``: bfloat16 on CUDA, float32 on CPU)."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        resolved = DTYPES[self.dtype]
        if resolved is None:
            resolved = torch.bfloat16 if self.resolved_device().startswith("cuda") else torch.float32
        return resolved
