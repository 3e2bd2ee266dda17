"""vLLM ``ColumnParallelLinear``: ``B`` sharded by output rows, all of ``A`` on every rank."""

from __future__ import annotations

import torch
import torch.nn as nn
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.model_executor.layers.linear import ColumnParallelLinear

from vllm_omni.diffusion.lora.geometry import LayerGeometry, OutputSlice, slices_from_sizes, tp_rank_and_size
from vllm_omni.diffusion.lora.layers.base import BaseLayerWithLoRA


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):
    """vLLM ``ColumnParallelLinear``: this rank's rows of ``B``; the delta is added before the
    optional all-gather (``gather_output``). Packed subclasses split the output into slices."""

    source_layer_type = ColumnParallelLinear

    @classmethod
    def geometry_of(cls, layer: nn.Module) -> LayerGeometry:
        rank, _ = tp_rank_and_size(layer)
        local = int(layer.output_size_per_partition)
        slices = (OutputSlice(0, int(layer.output_size), 0, local, rank),)
        return LayerGeometry(
            "column", layer.input_size, layer.input_size, 0, layer.output_size, local, slices, {}
        )

    @classmethod
    def _packed_geometry(
        cls,
        layer: nn.Module,
        global_sizes: list[int],
        local_sizes: list[int],
        shard_indices: list[int],
        shard_ids: dict[str | int, int],
    ) -> LayerGeometry:
        """A column-parallel layer whose output packs several slices (QKV, merged)."""
        slices = slices_from_sizes(global_sizes, local_sizes, shard_indices)
        return LayerGeometry(
            "column",
            layer.input_size,
            layer.input_size,
            0,
            sum(global_sizes),
            sum(local_sizes),
            slices,
            shard_ids,
        )

    def _collect(self, out: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if base.gather_output and base.tp_size > 1:
            return tensor_model_parallel_all_gather(out)
        return out
