"""Where a linear layer's LoRA rows and columns live on this tensor-parallel rank (the data types).

A LoRA update ``delta = B (A x)`` has to be split exactly like the base weight ``W`` it adds to:

* column-parallel layers (``ColumnParallelLinear`` and its packed subclasses) keep a slice of the
  output rows of ``W`` per rank, so each rank keeps the matching rows of ``B`` and all of ``A``;
* row-parallel layers keep a slice of the input columns of ``W``, so each rank keeps the matching
  columns of ``A`` and all of ``B``; the per-rank partial deltas are then summed by the layer's own
  all-reduce (``sum_r B (A_r x_r) = B (A x)``);
* replicated layers and plain ``nn.Linear`` keep everything.

Packed layers are split further into *output slices* (q/k/v, or the entries of ``output_sizes``);
each slice is sharded on its own, exactly as vLLM's weight loaders shard the base weight. Each layer
class in :mod:`.layers` computes its own :class:`LayerGeometry` (``geometry_of``).
"""

from __future__ import annotations

from dataclasses import dataclass


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


def tp_rank_and_size(layer: object) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` of a vLLM parallel layer; ``(0, 1)`` for a layer without them."""
    return int(getattr(layer, "tp_rank", 0)), int(getattr(layer, "tp_size", 1))


def slices_from_sizes(
    global_sizes: list[int], local_sizes: list[int], shard_indices: list[int]
) -> tuple[OutputSlice, ...]:
    """Consecutive output slices from per-slice global / local row counts and shard indices."""
    out: list[OutputSlice] = []
    g_off = 0
    l_off = 0
    for g, loc, idx in zip(global_sizes, local_sizes, shard_indices, strict=True):
        out.append(OutputSlice(g_off, g, l_off, loc, idx))
        g_off += g
        l_off += loc
    return tuple(out)
