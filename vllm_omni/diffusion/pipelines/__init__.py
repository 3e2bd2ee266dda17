"""Diffusion pipelines: in-tree ones (tensor-parallel denoisers) and the diffusers fallback."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

from vllm_omni.config.diffusion import IN_TREE_PIPELINES

if TYPE_CHECKING:
    from vllm_omni.config.diffusion import OmniDiffusionConfig
    from vllm_omni.diffusion.pipelines.base import DiffusionPipeline

FALLBACK_PIPELINE = "vllm_omni.diffusion.pipelines.diffusers_fallback:DiffusersFallbackPipeline"


def diffusers_dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``{"dtype": dtype}`` on diffusers releases that renamed ``torch_dtype``, else ``{"torch_dtype": dtype}``."""
    # only when a pipeline is built: every stage process imports this package (through
    # pipelines.base), and diffusers costs ~0.9 s CPU (measured) that LLM-only processes never need
    from diffusers.utils import deprecation_utils

    renamed = hasattr(deprecation_utils, "_TORCH_DTYPE_DEPRECATION_MESSAGE")
    return {"dtype": dtype} if renamed else {"torch_dtype": dtype}


def _resolve(target: str):
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def build_pipeline(
    od_config: OmniDiffusionConfig, device: str | torch.device | None = None
) -> DiffusionPipeline:
    """Instantiate the pipeline ``od_config`` selects (see ``OmniDiffusionConfig.use_in_tree``).

    The in-tree pipelines need ``init_diffusion_parallel_state`` to have run in this process.
    """
    target = IN_TREE_PIPELINES[od_config.class_name] if od_config.use_in_tree else FALLBACK_PIPELINE
    return _resolve(target)(od_config, device=device)


__all__ = ["FALLBACK_PIPELINE", "IN_TREE_PIPELINES", "build_pipeline", "diffusers_dtype_kwargs"]
