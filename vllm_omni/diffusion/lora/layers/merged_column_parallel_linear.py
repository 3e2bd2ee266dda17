"""vLLM ``MergedColumnParallelLinear`` (e.g. ``w13``): one output slice per ``output_sizes`` entry."""

from __future__ import annotations

import torch.nn as nn
from vllm.model_executor.layers.linear import MergedColumnParallelLinear

from vllm_omni.diffusion.lora.geometry import LayerGeometry, tp_rank_and_size
from vllm_omni.diffusion.lora.layers.column_parallel_linear import ColumnParallelLinearWithLoRA


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """vLLM ``MergedColumnParallelLinear``: each ``output_sizes`` slice sharded on its own across
    ranks (shard id ``i`` is slice ``i``), as vLLM's weight loader shards the base weight."""

    source_layer_type = MergedColumnParallelLinear

    @classmethod
    def geometry_of(cls, layer: nn.Module) -> LayerGeometry:
        """Raises ``TypeError`` when ``output_sizes`` do not match the local output."""
        rank, size = tp_rank_and_size(layer)
        global_sizes = [int(s) for s in layer.output_sizes]
        local = [s // size for s in global_sizes]
        if sum(local) != layer.output_size_per_partition:
            raise TypeError(
                f"{type(layer).__name__}: output_sizes do not match the local output; not supported"
            )
        shard_ids: dict[str | int, int] = {i: i for i in range(len(local))}
        return cls._packed_geometry(layer, global_sizes, local, [rank] * len(local), shard_ids)
