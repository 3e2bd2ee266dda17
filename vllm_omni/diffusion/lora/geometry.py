"""Where a linear layer's LoRA rows and columns live on this tensor-parallel rank.

A LoRA update ``delta = B (A x)`` has to be split exactly like the base weight ``W`` it adds to:

* column-parallel layers (``ColumnParallelLinear`` and its packed subclasses) keep a slice of the
  output rows of ``W`` per rank, so each rank keeps the matching rows of ``B`` and all of ``A``;
* row-parallel layers keep a slice of the input columns of ``W``, so each rank keeps the matching
  columns of ``A`` and all of ``B``; the per-rank partial deltas are then summed by the layer's own
  all-reduce (``sum_r B (A_r x_r) = B (A x)``);
* replicated layers and plain ``nn.Linear`` keep everything.

Packed layers (``QKVParallelLinear``, ``MergedColumnParallelLinear`` and ``MergedReplicatedLinear``)
are split further into *output slices* (q/k/v, or the entries of ``output_sizes``); each slice is
sharded on its own, exactly as vLLM's weight loaders shard the base weight (for QKV with fewer KV
heads than ranks, the K/V slices are replicated across ``num_kv_head_replicas`` ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)


@dataclass(frozen=True)
class OutputSlice:
    """One output slice of a (possibly packed) layer.

    Attributes:
        global_offset: first row of the slice in the full, unsharded output.
        global_size: rows of the slice in the full output.
        local_offset: first row of this rank's part of the slice in the layer's local output.
        local_size: rows of the slice held by this rank.
        shard_index: which ``local_size``-row block of the slice this rank holds.
    """

    global_offset: int
    global_size: int
    local_offset: int
    local_size: int
    shard_index: int

    def global_rows(self) -> tuple[int, int]:
        """``(start, length)`` of this rank's rows in the full output."""
        return self.global_offset + self.shard_index * self.local_size, self.local_size

    def rows_within_slice(self) -> tuple[int, int]:
        """``(start, length)`` of this rank's rows inside the slice."""
        return self.shard_index * self.local_size, self.local_size


@dataclass(frozen=True)
class LayerGeometry:
    """Shapes and sharding of a linear layer as seen from one rank.

    Attributes:
        kind: ``"replicated"``, ``"column"``, ``"row"`` or ``"linear"`` (plain ``nn.Linear``).
        in_features: full input width ``d_in``.
        in_local: input width on this rank (``d_in / tp`` for row-parallel layers).
        in_start: first input column held by this rank.
        out_features: full output width.
        out_local: output rows on this rank.
        slices: output slices (one for unpacked layers).
        shard_ids: ``stacked_params_mapping`` shard id (``"q"``/``"k"``/``"v"`` or an int) -> slice index.
    """

    kind: str
    in_features: int
    in_local: int
    in_start: int
    out_features: int
    out_local: int
    slices: tuple[OutputSlice, ...]
    shard_ids: dict[str | int, int]

    @property
    def packed(self) -> bool:
        return len(self.slices) > 1


def _tp(layer: nn.Module) -> tuple[int, int]:
    return int(getattr(layer, "tp_rank", 0)), int(getattr(layer, "tp_size", 1))


def _slices_from_sizes(
    global_sizes: list[int], local_sizes: list[int], shard_indices: list[int]
) -> tuple[OutputSlice, ...]:
    out: list[OutputSlice] = []
    g_off = 0
    l_off = 0
    for g, loc, idx in zip(global_sizes, local_sizes, shard_indices, strict=True):
        out.append(OutputSlice(g_off, g, l_off, loc, idx))
        g_off += g
        l_off += loc
    return tuple(out)


def is_supported_linear(module: nn.Module) -> bool:
    """Whether :func:`layer_geometry` (and the LoRA wrappers) handle this module type."""
    return isinstance(module, (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear, nn.Linear))


def layer_geometry(layer: nn.Module) -> LayerGeometry:
    """Describe ``layer``'s LoRA geometry on this rank.

    Supports ``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``ColumnParallelLinear``,
    ``RowParallelLinear``, ``ReplicatedLinear`` (and ``MergedReplicatedLinear`` via its
    ``output_sizes``) and ``torch.nn.Linear``.

    Raises:
        TypeError: for any other module, or a subclass whose output layout does not add up (e.g. a
            QKV layer with extra indexer heads).
    """
    if isinstance(layer, QKVParallelLinear):
        rank, _ = _tp(layer)
        replicas = int(getattr(layer, "num_kv_head_replicas", 1))
        kv_index = rank // replicas
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
        slices = _slices_from_sizes(global_sizes, local, [rank, kv_index, kv_index])
        return LayerGeometry(
            "column",
            layer.input_size,
            layer.input_size,
            0,
            sum(global_sizes),
            sum(local),
            slices,
            {"q": 0, "k": 1, "v": 2},
        )
    if isinstance(layer, MergedColumnParallelLinear):
        rank, size = _tp(layer)
        global_sizes = [int(s) for s in layer.output_sizes]
        local = [s // size for s in global_sizes]
        if sum(local) != layer.output_size_per_partition:
            raise TypeError(
                f"{type(layer).__name__}: output_sizes do not match the local output; not supported"
            )
        slices = _slices_from_sizes(global_sizes, local, [rank] * len(local))
        return LayerGeometry(
            "column",
            layer.input_size,
            layer.input_size,
            0,
            sum(global_sizes),
            sum(local),
            slices,
            {i: i for i in range(len(local))},
        )
    if isinstance(layer, ColumnParallelLinear):
        rank, _ = _tp(layer)
        local = int(layer.output_size_per_partition)
        slices = (OutputSlice(0, int(layer.output_size), 0, local, rank),)
        return LayerGeometry(
            "column", layer.input_size, layer.input_size, 0, layer.output_size, local, slices, {}
        )
    if isinstance(layer, RowParallelLinear):
        rank, _ = _tp(layer)
        in_local = int(layer.input_size_per_partition)
        slices = (OutputSlice(0, int(layer.output_size), 0, int(layer.output_size), 0),)
        return LayerGeometry(
            "row",
            layer.input_size,
            in_local,
            rank * in_local,
            layer.output_size,
            layer.output_size,
            slices,
            {},
        )
    if isinstance(layer, ReplicatedLinear):
        sizes = [int(s) for s in getattr(layer, "output_sizes", [layer.output_size])]
        if sum(sizes) != layer.output_size:
            raise TypeError(f"{type(layer).__name__}: output_sizes do not add up to output_size")
        slices = _slices_from_sizes(sizes, sizes, [0] * len(sizes))
        shard_ids: dict[str | int, int] = {i: i for i in range(len(sizes))} if len(sizes) > 1 else {}
        return LayerGeometry(
            "replicated",
            layer.input_size,
            layer.input_size,
            0,
            layer.output_size,
            layer.output_size,
            slices,
            shard_ids,
        )
    if isinstance(layer, nn.Linear):
        slices = (OutputSlice(0, layer.out_features, 0, layer.out_features, 0),)
        return LayerGeometry(
            "linear",
            layer.in_features,
            layer.in_features,
            0,
            layer.out_features,
            layer.out_features,
            slices,
            {},
        )
    if isinstance(layer, LinearBase):
        raise TypeError(f"{type(layer).__name__} is not supported by the diffusion LoRA wrappers")
    raise TypeError(f"{type(layer).__name__} is not a linear layer")
