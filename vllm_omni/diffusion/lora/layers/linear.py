"""``torch.nn.Linear`` (the diffusers fallback path): no sharding, returns a tensor."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_omni.diffusion.lora.geometry import LayerGeometry, OutputSlice
from vllm_omni.diffusion.lora.layers.base import BaseLayerWithLoRA


class LinearWithLoRA(BaseLayerWithLoRA):
    """``torch.nn.Linear``: one output slice, full ``A`` and ``B``; returns a tensor like the base layer."""

    source_layer_type = nn.Linear

    @classmethod
    def geometry_of(cls, layer: nn.Module) -> LayerGeometry:
        out = layer.out_features
        slices = (OutputSlice(0, out, 0, out, 0),)
        return LayerGeometry("linear", layer.in_features, layer.in_features, 0, out, out, slices, {})

    def _base_output(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        return F.linear(x, base.weight, base.bias)

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        return out
