"""The two shapes of one adapter's weights for one layer: as bound (host, unsharded) and as laid
out for the forward on this rank.

:func:`.targets.bind_adapter` produces :class:`LayerLoRAWeights`; a layer's
:meth:`~.layers.BaseLayerWithLoRA.prepare` turns them into :class:`SlotWeights` once, when the
adapter enters the host cache; a device slot then holds those (a reference on a CPU model, one
host-to-device copy per tensor elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerLoRAWeights:
    """One adapter's weights for one (possibly packed) layer, unsharded, on the host.

    Attributes:
        slices: per output slice of the layer, ``(A [r, d_in], s*B [slice_rows, r])`` float32, or
            ``None`` when the adapter leaves that slice untouched (it then stays exactly zero).
        shared_a: every present slice uses the same ``A`` (the adapter targeted the packed layer by
            its own name); the forward then computes ``A x`` once.
        rank_limited: every slice comes from a LoRA module, so ``max_rank`` applies (LoHa / LoKr
            equivalents are exempt).
        biases: per output slice ``s * b`` ``[slice_rows]`` float32 (or ``None`` for a slice without
            one), or ``None`` when the adapter has no bias delta for this layer (distill only).
    """

    slices: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    shared_a: bool = False
    rank_limited: bool = True
    biases: tuple[torch.Tensor | None, ...] | None = None


@dataclass(frozen=True)
class SlotWeights:
    """One adapter's LoRA for one layer on this rank, laid out for the forward pass.

    Attributes:
        a: ``[sum of the parts' ranks, in_local]``: the ``A`` rows of every part stacked, so one
            shrink ``h = x a^T`` serves all parts (a shared ``A`` appears once).
        parts: per part ``(h_start, rank, out_offset, out_size)``: columns ``h[:, h_start:h_start +
            rank]`` update the local output columns ``out_offset:out_offset + out_size``.
        bt: per part ``(s B_local)^T``, ``[rank, out_size]``, contiguous (the expand operand).
        ranks: rank per output slice of the layer (``0``: the slice is left alone).
        shared_a: the adapter targeted the packed layer by its own name (one ``A`` for all slices).
        bias: ``s * b`` on this rank's local output, ``[out_local]`` (zeros outside the slices that have
            one), or ``None``: the adapter's bias delta (lightx2v ``diff_b``), added as ``lambda * bias``
            to every row the slot applies to; on a row-parallel layer only rank 0 holds it (the
            all-reduce adds it once).
    """

    a: torch.Tensor
    parts: tuple[tuple[int, int, int, int], ...]
    bt: tuple[torch.Tensor, ...]
    ranks: tuple[int, ...]
    shared_a: bool = False
    bias: torch.Tensor | None = None

    def to(self, device: torch.device, dtype: torch.dtype) -> SlotWeights:
        """These weights on ``device`` in ``dtype``; ``self`` (no copy) when already there."""
        tensors = self.tensors()
        if all(t.device == device and t.dtype == dtype for t in tensors):
            return self
        moved = [t.to(device=device, dtype=dtype, non_blocking=True) for t in tensors]
        bias = moved.pop() if self.bias is not None else None
        return SlotWeights(moved[0], self.parts, tuple(moved[1:]), self.ranks, self.shared_a, bias)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``a``, every ``bt`` and the bias when there is one (e.g. to measure the memory held)."""
        return (self.a, *self.bt) + (() if self.bias is None else (self.bias,))
