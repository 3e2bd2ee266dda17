"""vLLM ``QKVParallelLinear`` (``to_qkv``): q / k / v output slices."""

from __future__ import annotations

import torch.nn as nn
from vllm.model_executor.layers.linear import QKVParallelLinear

from vllm_omni.diffusion.lora.geometry import LayerGeometry, tp_rank_and_size
from vllm_omni.diffusion.lora.layers.column_parallel_linear import ColumnParallelLinearWithLoRA


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """vLLM ``QKVParallelLinear``: q / k / v slices (shard ids ``"q"``, ``"k"``, ``"v"``) with GQA
    sizes; with fewer KV heads than ranks the K / V slices are replicated across
    ``num_kv_head_replicas`` ranks, as the base weight is."""

    source_layer_type = QKVParallelLinear

    @classmethod
    def geometry_of(cls, layer: nn.Module) -> LayerGeometry:
        """Raises ``TypeError`` for a subclass whose output is not plain q/k/v (e.g. extra indexer heads)."""
        rank, _ = tp_rank_and_size(layer)
        kv_index = rank // int(getattr(layer, "num_kv_head_replicas", 1))
        local = [
            layer.num_heads * layer.head_size,
            layer.num_kv_heads * layer.head_size,
            layer.num_kv_heads * layer.v_head_size,
        ]
        global_sizes = [
            layer.total_num_heads * layer.head_size,
            layer.total_num_kv_heads * layer.head_size,
            layer.total_num_kv_heads * layer.v_head_size,
        ]
        if sum(local) != layer.output_size_per_partition:
            raise TypeError(f"{type(layer).__name__}: output layout is not plain q/k/v; not supported")
        shard_ids: dict[str | int, int] = {"q": 0, "k": 1, "v": 2}
        return cls._packed_geometry(layer, global_sizes, local, [rank, kv_index, kv_index], shard_ids)
