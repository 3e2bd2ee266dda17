"""The Flux family: the in-tree Flux denoiser (FLUX.1-dev, FLUX.1-schnell, FLUX.1-Kontext) and its spec.

Names resolve on first use, so reading the spec (the config layer does, before any model loads) imports
no model code.
"""

from __future__ import annotations

import importlib

_LAZY = {"FluxTransformer2DModel": "vllm_omni.diffusion.models.flux.flux_transformer"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FluxTransformer2DModel"]
