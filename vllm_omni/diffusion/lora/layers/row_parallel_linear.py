"""vLLM ``RowParallelLinear``: ``A`` sharded by input columns, all of ``B`` on every rank."""

from __future__ import annotations

import torch
import torch.nn as nn
from vllm.distributed import split_tensor_along_last_dim, tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import RowParallelLinear

from vllm_omni.diffusion.lora.geometry import LayerGeometry, OutputSlice, tp_rank_and_size
from vllm_omni.diffusion.lora.layers.base import BaseLayerWithLoRA


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    """vLLM ``RowParallelLinear``: this rank's columns of ``A``; the partial delta is added before
    the all-reduce, which sums it into exactly ``B (A x)``; the bias is added on rank 0 only."""

    source_layer_type = RowParallelLinear

    @classmethod
    def geometry_of(cls, layer: nn.Module) -> LayerGeometry:
        rank, _ = tp_rank_and_size(layer)
        in_local = int(layer.input_size_per_partition)
        out = int(layer.output_size)
        slices = (OutputSlice(0, out, 0, out, 0),)
        return LayerGeometry("row", layer.input_size, in_local, rank * in_local, out, out, slices, {})

    def _local_input(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if base.input_is_parallel:
            return x
        return split_tensor_along_last_dim(x, num_partitions=base.tp_size)[base.tp_rank].contiguous()

    def _bias(self) -> torch.Tensor | None:
        base = self.base_layer
        return None if (base.tp_rank > 0 or base.skip_bias_add) else base.bias

    def _collect(self, out: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if base.reduce_results and base.tp_size > 1:
            return tensor_model_parallel_all_reduce(out)
        return out
