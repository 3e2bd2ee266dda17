"""The Qwen-Image family: the in-tree Qwen-Image denoiser, text-to-image and edit pipelines (one folder: ``spec.py`` with ``SPEC``, the denoiser, the pipelines).

Names resolve on first use, so reading the spec (the config layer does, before any model loads) imports
no model code.
"""

from __future__ import annotations

import importlib

_LAZY = {"QwenImageTransformer2DModel": "vllm_omni.diffusion.models.qwen_image.qwen_image_transformer"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["QwenImageTransformer2DModel"]
