"""LoRA layer classes for diffusion denoisers, one module per layer kind (cf. ``vllm.lora.layers``).

:data:`LORA_LAYER_CLASSES` lists them most specific first; :func:`wrapper_class_for` asks each
``can_replace_layer`` in that order, so knowledge of a layer kind lives only in its class.
"""

from __future__ import annotations

import torch.nn as nn

from vllm_omni.diffusion.lora.layers.base import BaseLayerWithLoRA
from vllm_omni.diffusion.lora.layers.column_parallel_linear import ColumnParallelLinearWithLoRA
from vllm_omni.diffusion.lora.layers.linear import LinearWithLoRA
from vllm_omni.diffusion.lora.layers.merged_column_parallel_linear import MergedColumnParallelLinearWithLoRA
from vllm_omni.diffusion.lora.layers.qkv_parallel_linear import QKVParallelLinearWithLoRA
from vllm_omni.diffusion.lora.layers.replicated_linear import ReplicatedLinearWithLoRA
from vllm_omni.diffusion.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA

#: every LoRA layer class, most specific first (a subclass's layer kind before its base's).
LORA_LAYER_CLASSES: tuple[type[BaseLayerWithLoRA], ...] = (
    QKVParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    ColumnParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
    ReplicatedLinearWithLoRA,
    LinearWithLoRA,
)


def wrapper_class_for(module: nn.Module) -> type[BaseLayerWithLoRA] | None:
    """The first class of :data:`LORA_LAYER_CLASSES` that can replace ``module``, or ``None``
    (not a supported linear layer, or already a LoRA layer)."""
    if isinstance(module, BaseLayerWithLoRA):
        return None
    for lora_cls in LORA_LAYER_CLASSES:
        if lora_cls.can_replace_layer(module):
            return lora_cls
    return None


__all__ = [
    "LORA_LAYER_CLASSES",
    "BaseLayerWithLoRA",
    "ColumnParallelLinearWithLoRA",
    "LinearWithLoRA",
    "MergedColumnParallelLinearWithLoRA",
    "QKVParallelLinearWithLoRA",
    "ReplicatedLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "wrapper_class_for",
]
