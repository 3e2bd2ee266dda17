"""The LoRA math of the diffusion layers, under the field's names (cf. vLLM's punica ops).

For one slot with weights ``(A, s B)`` and scale ``lambda``, on rows ``x`` of a layer whose base
output is ``y``::

    h = lambda * x A^T            lora_shrink    [rows, sum r]
    y[:, part] += h_part (s B)^T  lora_expand    one in-place GEMM per output part

``A`` rows of every part (q / k / v of a packed layer, or several adapters stacked by
:func:`stack_slot_weights`) are stacked, so the shrink is always one GEMM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vllm_omni.diffusion.lora.weights import SlotWeights


def lora_shrink(x: torch.Tensor, a: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``h = scale * x a^T``.

    Args:
        x: ``[rows, in_local]`` (cast to ``a``'s dtype when it differs).
        a: ``[sum r, in_local]``, the stacked ``A`` rows.
        scale: ``None`` or ``1.0`` leaves ``h`` unscaled.

    Returns:
        ``[rows, sum r]`` in ``a``'s dtype.
    """
    if x.dtype != a.dtype:
        x = x.to(a.dtype)
    h = F.linear(x, a)
    if scale is not None and scale != 1.0:
        h.mul_(scale)
    return h


def lora_expand(
    h: torch.Tensor,
    y: torch.Tensor,
    parts: Sequence[tuple[int, int, int, int]],
    bt: Sequence[torch.Tensor],
) -> None:
    """``y[..., offset:offset + size] += h[:, h_start:h_start + rank] @ bt`` for every part, in place.

    Args:
        h: ``[rows, sum r]`` from :func:`lora_shrink`.
        y: ``[..., out_local]`` with ``rows`` leading elements; updated with ``addmm_`` (no delta
            tensor) when it is contiguous and of ``h``'s dtype, else a delta is cast and added.
        parts: ``(h_start, rank, out_offset, out_size)`` per part (see :class:`.weights.SlotWeights`).
        bt: per part ``[rank, out_size]``.
    """
    y2 = y.view(-1, y.shape[-1]) if (y.is_contiguous() and y.dtype == h.dtype) else None
    whole_h = len(parts) == 1 and parts[0][1] == h.shape[-1]
    for (h_start, rank, offset, size), part_bt in zip(parts, bt, strict=True):
        hp = h if whole_h else h.narrow(-1, h_start, rank)
        if y2 is not None:
            target = y2 if (offset == 0 and size == y2.shape[-1]) else y2.narrow(-1, offset, size)
            target.addmm_(hp, part_bt)
            continue
        delta = (hp @ part_bt).view(*y.shape[:-1], -1).to(y.dtype)
        target = y if (offset == 0 and size == y.shape[-1]) else y.narrow(-1, offset, size)
        target.add_(delta)


def add_lora(x: torch.Tensor, y: torch.Tensor, w: SlotWeights, scale: float | None) -> None:
    """Add ``scale * B (A x)`` of one slot to ``y`` in place (shrink, then expand).

    Args:
        x: ``[..., in_local]``.
        y: ``[..., out_local]``, same leading shape as ``x``.
        w: the slot's weights on ``y``'s device.
        scale: the slot's scale for these rows (``None``: 1).
    """
    h = lora_shrink(x.reshape(-1, x.shape[-1]), w.a, scale)
    lora_expand(h, y, w.parts, w.bt)


def _bank_expand(y: torch.Tensor, h: torch.Tensor, bts: list[torch.Tensor]) -> None:
    width = bts[0].shape[0]
    offset = 0
    for i, bt in enumerate(bts):
        size = bt.shape[1]
        target = y if size == y.shape[1] else y.narrow(1, offset, size)
        target.addmm_(h.narrow(1, i * width, width), bt)
        offset += size


# A plain ``torch.library`` definition rather than ``torch.library.custom_op``: the latter's Python
# wrapper costs ~11 us a call against ~3 us (measured on CPU), paid once per LoRA layer per block call.
_LIB = torch.library.Library("vllm_omni", "FRAGMENT")
_LIB.define("lora_bank_expand_(Tensor(a!) y, Tensor h, Tensor[] bts) -> ()")
_LIB.impl("lora_bank_expand_", _bank_expand, "CompositeExplicitAutograd")
torch.library.register_fake("vllm_omni::lora_bank_expand_", lambda y, h, bts: None, lib=_LIB)


def bank_expand_(y: torch.Tensor, h: torch.Tensor, bts: list[torch.Tensor]) -> None:
    """``y[:, slice i] += h[:, i * width:(i + 1) * width] @ bts[i]`` for every slice, in place.

    The expand of a compiled LoRA bank (:meth:`.banks.LoRABank.add_delta`) as one opaque op
    (``torch.ops.vllm_omni.lora_bank_expand_``) that mutates ``y``: inductor re-inplaces it on the
    base GEMM's output, so the delta is accumulated by the GEMM itself (``addmm_``, BLAS
    ``beta = 1``) as on the eager path, with one rounding of ``y`` in bfloat16 as there, instead of
    a delta tensor rounded to the dtype and added in another pass.

    Args:
        y: ``[rows, out_local]`` contiguous, of ``h``'s dtype; the slices tile it in order, slice
            ``i`` being ``bts[i].shape[1]`` columns wide.
        h: ``[rows, len(bts) * width]`` with ``width = bts[i].shape[0]``.
        bts: per output slice ``[width, slice_size]``.
    """
    torch.ops.vllm_omni.lora_bank_expand_.default(y, h, bts)


def stack_slot_weights(held: Sequence[tuple[SlotWeights, float]]) -> SlotWeights | None:
    """Several slots applied to every row, each with one scale, as one :class:`SlotWeights`.

    ``sum_j lambda_j B_j A_j x`` is then one shrink over all adapters' ``A`` rows (scales folded
    into ``A``) and one expand per distinct output range over all their ``B`` columns, so input
    and output are each passed over once instead of K times.

    Args:
        held: ``(weights, scale)`` of each active slot.

    Returns:
        The stacked weights (``ranks`` empty), or ``None`` for fewer than two slots.
    """
    stacked = _stack(held, fold_scales=True)
    return None if stacked is None else stacked[0]


def stack_slot_weights_unscaled(
    held: Sequence[SlotWeights],
) -> tuple[SlotWeights, tuple[tuple[int, int], ...]] | None:
    """Several slots stacked as in :func:`stack_slot_weights` but with the scales left out.

    For scales that change between steps (schedules): the stack is built once and each step only
    multiplies ``h`` by the row scales (:func:`row_scales`), so no weight is copied per step.

    Returns:
        ``(weights, segments)`` with ``segments`` the ``(rows, index into held)`` of the stacked
        ``A`` rows in order, or ``None`` for fewer than two slots.
    """
    return _stack([(w, 1.0) for w in held], fold_scales=False)


def row_scales(
    segments: Sequence[tuple[int, int]], scales: Sequence[float], like: torch.Tensor
) -> torch.Tensor:
    """``[sum rows]`` scales of the stacked ``A`` rows (``scales[i]`` for the rows of ``held[i]``)."""
    values = [float(scales[i]) for n, i in segments for _ in range(n)]
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _stack(held, fold_scales: bool):
    if len(held) < 2:
        return None
    groups: dict[tuple[int, int], list[tuple[torch.Tensor, float, torch.Tensor, int]]] = {}
    for index, (w, scale) in enumerate(held):
        for (h_start, rank, offset, size), bt in zip(w.parts, w.bt, strict=True):
            groups.setdefault((offset, size), []).append((w.a[h_start : h_start + rank], scale, bt, index))
    rows: list[torch.Tensor] = []
    parts: list[tuple[int, int, int, int]] = []
    bts: list[torch.Tensor] = []
    segments: list[tuple[int, int]] = []
    start = 0
    for (offset, size), items in groups.items():
        rank = sum(a.shape[0] for a, _, _, _ in items)
        rows += [a if (scale == 1.0 or not fold_scales) else a * scale for a, scale, _, _ in items]
        segments += [(a.shape[0], index) for a, _, _, index in items]
        bts.append(torch.cat([bt for _, _, bt, _ in items]) if len(items) > 1 else items[0][2])
        parts.append((start, rank, offset, size))
        start += rank
    stacked = SlotWeights(torch.cat(rows), tuple(parts), tuple(bts), ranks=(), shared_a=False)
    return stacked, tuple(segments)
