"""Output type of the diffusion runtime; re-exports the stage config (``OmniDiffusionConfig``).

``OmniDiffusionConfig`` lives in :mod:`vllm_omni.config.diffusion` so that ``config/`` never
imports the diffusion runtime; it stays importable from here (the spec names this path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni.config.diffusion import (
    DTYPES,
    IN_TREE_PIPELINES,
    LORA_BACKENDS,
    PIPELINE_BACKENDS,
    OmniDiffusionConfig,
)

__all__ = [
    "DTYPES",
    "LORA_BACKENDS",
    "PIPELINE_BACKENDS",
    "DiffusionOutput",
    "OmniDiffusionConfig",
    "in_tree_pipeline_classes",
]


def in_tree_pipeline_classes() -> tuple[str, ...]:
    """``_class_name`` values of ``model_index.json`` that have an in-tree pipeline."""
    return tuple(IN_TREE_PIPELINES)


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
