"""The Wan family: the in-tree Wan (2.1 / 2.2) video denoiser on vLLM tensor-parallel layers and its pipelines (one folder: ``spec.py`` with ``SPEC``, the denoiser, the pipelines).

Names resolve on first use, so reading the spec (the config layer does, before any model loads) imports
no model code.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "WanTransformer3DModel": "vllm_omni.diffusion.models.wan.wan_transformer",
    "WanTransformerBlock": "vllm_omni.diffusion.models.wan.wan_transformer",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["WanTransformer3DModel", "WanTransformerBlock"]
