"""vLLM ``ReplicatedLinear`` (e.g. adaLN modulation) and ``MergedReplicatedLinear``."""

from __future__ import annotations

import torch.nn as nn
from vllm.model_executor.layers.linear import ReplicatedLinear

from vllm_omni.diffusion.lora.geometry import LayerGeometry, slices_from_sizes
from vllm_omni.diffusion.lora.layers.base import BaseLayerWithLoRA


class ReplicatedLinearWithLoRA(BaseLayerWithLoRA):
    """vLLM ``ReplicatedLinear``: full ``A`` and ``B`` on every rank; one output slice per entry
    of ``output_sizes`` when the layer has them (``MergedReplicatedLinear``)."""

    source_layer_type = ReplicatedLinear

    @classmethod
    def geometry_of(cls, layer: nn.Module) -> LayerGeometry:
        """Raises ``TypeError`` when ``output_sizes`` do not add up to ``output_size``."""
        sizes = [int(s) for s in getattr(layer, "output_sizes", [layer.output_size])]
        if sum(sizes) != layer.output_size:
            raise TypeError(f"{type(layer).__name__}: output_sizes do not add up to output_size")
        slices = slices_from_sizes(sizes, sizes, [0] * len(sizes))
        shard_ids: dict[str | int, int] = {i: i for i in range(len(sizes))} if len(sizes) > 1 else {}
        out = layer.output_size
        return LayerGeometry("replicated", layer.input_size, layer.input_size, 0, out, out, slices, shard_ids)
