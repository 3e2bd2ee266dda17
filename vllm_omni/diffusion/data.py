"""Configuration and output types of the diffusion runtime."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PIPELINE_BACKENDS = ("auto", "in_tree", "diffusers")
LORA_BACKENDS = ("peft", "distill")
DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def in_tree_pipeline_classes() -> tuple[str, ...]:
    """``_class_name`` values of ``model_index.json`` that have an in-tree pipeline."""
    from vllm_omni.diffusion.pipelines import IN_TREE_PIPELINES

    return tuple(IN_TREE_PIPELINES)


@dataclass
class OmniDiffusionConfig:
    """Engine-level settings of a diffusion stage.

    Attributes:
        model: local diffusers-format directory holding ``model_index.json`` and one
            folder per component (no hub ids: nothing is downloaded).
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), a name from ``DTYPES`` or a torch dtype.
        tensor_parallel_size: ranks sharding the in-tree denoiser (``>= 1``); ``> 1`` runs
            one worker process per rank and needs the in-tree backend.
        device: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available). With TP each rank
            uses ``cuda:<rank>``.
        pipeline_backend: ``"auto"`` (in-tree when ``_class_name`` has one, else diffusers),
            ``"in_tree"`` or ``"diffusers"``.
        enable_progress_bar: show a tqdm bar over denoising steps (only when stderr is a TTY).
        keep_base_weights: keep dense base weights in ``layer.weight`` of vLLM linear
            layers on CPU instead of repacking (see ``finalize_linear_layers``).
        distributed_init_method: torch.distributed URL for TP workers; ``None`` picks a temp file.
        lora_path: adapter directory (or list) to load at start-up; ``None`` for none.
        lora_scale: scale applied to ``lora_path`` adapters.
        lora_backend: ``"peft"`` or ``"distill"``.
        max_loras: adapters active at once (``>= 1``).
        max_cpu_loras: adapters cached on CPU; ``None`` means ``max_loras`` plus the number of
            start-up PEFT adapters (``lora_path``, which are pinned); must be ``>= max_loras``.
        max_lora_rank: largest LoRA rank the PEFT backend accepts (device buffers are sized for it).

    Raises:
        ValueError: (on construction) naming the field and allowed values, for an unknown
            backend/dtype, a missing directory, ``model_index.json`` or component folder,
            ``pipeline_backend="in_tree"`` with a class that has no in-tree pipeline, TP
            ``> 1`` without the in-tree pipeline, or bad LoRA limits.
    """

    model: str
    dtype: str | torch.dtype = "auto"
    tensor_parallel_size: int = 1
    device: str | None = None
    pipeline_backend: str = "auto"
    enable_progress_bar: bool = True
    keep_base_weights: bool = True
    distributed_init_method: str | None = None
    lora_path: str | list[str] | None = None
    lora_scale: float = 1.0
    lora_backend: str = "peft"
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 64
    model_index: dict[str, Any] = field(default_factory=dict, repr=False, init=False)

    def __post_init__(self) -> None:
        self.model = str(self.model)
        root = Path(self.model)
        if not root.is_dir():
            raise ValueError(f"model must be a local diffusers directory; {self.model!r} is not a directory")
        index_path = root / "model_index.json"
        if not index_path.is_file():
            raise ValueError(f"model directory {self.model!r} has no model_index.json")
        self.model_index = json.loads(index_path.read_text())
        missing = [name for name, spec in self.components.items() if spec and not (root / name).is_dir()]
        if missing:
            raise ValueError(f"model directory {self.model!r} lacks component folders {missing}")
        if self.pipeline_backend not in PIPELINE_BACKENDS:
            raise ValueError(
                f"pipeline_backend must be one of {list(PIPELINE_BACKENDS)}, got {self.pipeline_backend!r}"
            )
        in_tree = in_tree_pipeline_classes()
        if self.pipeline_backend == "in_tree" and self.class_name not in in_tree:
            raise ValueError(
                f"unknown pipeline class {self.class_name!r} for pipeline_backend='in_tree'; "
                f"in-tree pipelines: {list(in_tree)}"
            )
        if not self.use_in_tree:
            import diffusers

            if not hasattr(diffusers, self.class_name):
                raise ValueError(
                    f"unknown pipeline class {self.class_name!r}: neither an in-tree pipeline {list(in_tree)} "
                    f"nor a diffusers pipeline class"
                )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}"
            )
        if self.tensor_parallel_size > 1 and not self.use_in_tree:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs an in-tree pipeline "
                f"(pipeline_backend 'auto' or 'in_tree' with _class_name in {list(in_tree)}); "
                f"got {self.class_name!r} with pipeline_backend={self.pipeline_backend!r}"
            )
        if not isinstance(self.dtype, torch.dtype) and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be a torch.dtype or one of {list(DTYPES)}, got {self.dtype!r}")
        if self.device is not None and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or None, got {self.device!r}")
        paths = [self.lora_path] if isinstance(self.lora_path, str) else self.lora_path
        if paths is not None and (not isinstance(paths, list) or not all(isinstance(p, str) for p in paths)):
            raise ValueError(
                f"lora_path must be None, a path string or a list of path strings, got {self.lora_path!r}"
            )
        if isinstance(self.lora_scale, bool) or not isinstance(self.lora_scale, int | float):
            raise ValueError(f"lora_scale must be a number, got {self.lora_scale!r}")
        if self.lora_backend not in LORA_BACKENDS:
            raise ValueError(f"lora_backend must be one of {list(LORA_BACKENDS)}, got {self.lora_backend!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be >= 1 (an integer), got {value!r}")
        startup = len(self.startup_lora_paths) if self.lora_backend == "peft" else 0
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras + startup
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if startup and self.max_cpu_loras < startup:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) is smaller than the {startup} start-up adapter(s) of "
                f"lora_path, which are pinned in the cache; raise max_cpu_loras"
            )
        if self.lora_backend == "distill" and self.startup_lora_paths and not self.keep_base_weights:
            raise ValueError(
                "lora_backend='distill' fuses into the dense base weights and needs keep_base_weights=True"
            )

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
        """Whether the engine runs the in-tree pipeline for this directory."""
        if self.pipeline_backend == "diffusers":
            return False
        return self.class_name in in_tree_pipeline_classes()

    def resolved_device(self) -> str:
        """``device`` or, when ``None``, ``"cuda"`` if available else ``"cpu"``."""
        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def torch_dtype(self) -> torch.dtype:
        """The concrete torch dtype (``"auto"``: bfloat16 on CUDA, float32 on CPU)."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        resolved = DTYPES[self.dtype]
        if resolved is None:
            resolved = torch.bfloat16 if self.resolved_device().startswith("cuda") else torch.float32
        return resolved


@dataclass
class DiffusionOutput:
    """Result for one prompt.

    Attributes:
        prompt: the prompt text.
        images: ``num_images_per_prompt`` PIL images (``output_type="pil"``), empty for ``"latent"``.
        latents: final denoised latents ``(num_images_per_prompt, C, h, w)`` float32 on CPU
            when the pipeline exposes them (always in-tree; fallback only for ``"latent"``).
        array: decoded images as ``np.ndarray`` ``(N, H, W, 3)`` float in ``[0, 1]`` (``"np"``) or
            ``torch.Tensor`` ``(N, 3, H, W)`` (``"pt"``); ``None`` otherwise. Video pipelines:
            whatever diffusers returns as ``frames``, ``(N, frames, ...)``.
        videos: video pipelines with ``output_type="pil"``: ``num_images_per_prompt`` videos,
            each a list of PIL frames; empty otherwise (``images`` stays empty for videos).
    """

    prompt: str
    images: list[Any] = field(default_factory=list)
    latents: torch.Tensor | None = None
    array: Any = None
    videos: list[list[Any]] = field(default_factory=list)
