"""The merged fast path of a diffusion denoiser: one adapter folded into the base weights.

A stage that serves one adapter at one constant scale for whole batches (an RL rollout step, a
style served for hours) pays the LoRA shrink and expand in every LoRA layer at every denoising
step. With ``lora_merge=True`` (``OmniDiffusionConfig``; default ``False``) the manager folds the
adapter into the base weights instead, once:

    W' = W + lambda * sum_parts  (s B_part)^T-rows  A_part        (per layer, on this rank's shard)

computed in float32 from the slot's laid-out weights (:class:`~.weights.SlotWeights`: ``a`` holds
the parts' ``A`` rows, ``bt[i]`` is ``(s B)^T`` of part ``i`` for output rows
``out_offset:out_offset + out_size``) and rounded once to the weight's dtype; a row-parallel shard
gets its local columns, so the all-reduce sums exactly the merged product. The forward then runs
the base layers alone. The original weights are kept (a copy of every merged layer's weight) and
copied back **bitwise** before anything else runs: a batch with another adapter, another scale,
several adapters, a schedule or mixed rows (never merged), a batch without adapters (the
denoiser's forward pre-hook restores first), or the adapter's removal.

Merged outputs equal the un-merged path up to the dtype's rounding: ``x W'^T`` rounds once where
the un-merged path rounds ``x W^T`` and the delta separately. Only layers whose weight is a plain
dense floating-point ``[out_local, in_local]`` tensor are merged (``torch.nn.Linear``, vLLM's
unquantized linear layers); an adapter touching any other layer is served un-merged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

__all__ = ["MergedWeights", "dense_weight"]


def dense_weight(wrapper: nn.Module) -> torch.Tensor | None:
    """The base layer's dense ``[out_local, in_local]`` floating-point weight, or ``None`` when it has
    none (quantised or repacked layers cannot be merged into)."""
    base = wrapper.base_layer
    weight = getattr(base, "weight", None)
    method = getattr(base, "quant_method", None)
    if method is not None and type(method).__name__ != "UnquantizedLinearMethod":
        return None
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not weight.is_floating_point():
        return None
    g = wrapper.geometry
    return weight if tuple(weight.shape) == (g.out_local, g.in_local) else None


class MergedWeights:
    """Which adapter is merged into one manager's denoiser layers, and the base weights to restore.

    Attributes:
        key: ``(lora_int_id, scale)`` merged now, or ``None`` (base weights in place).
        in_use: an activation is serving the merged weights (the pre-hook leaves them alone).
        merges / restores: counters (tests and statistics).
    """

    def __init__(self) -> None:
        self.key: tuple[int, float] | None = None
        self.in_use = False
        self.merges = 0
        self.restores = 0
        self._saved: dict[str, torch.Tensor] = {}

    def mergeable(self, wrappers: Mapping[str, nn.Module], slot: int) -> bool:
        """Whether every layer the adapter in ``slot`` touches has a dense weight to merge into."""
        touched = [w for w in wrappers.values() if w.slot_weights(slot) is not None]
        return bool(touched) and all(dense_weight(w) is not None for w in touched)

    @torch.no_grad()
    def merge(self, wrappers: Mapping[str, nn.Module], slot: int, key: tuple[int, float]) -> None:
        """Fold the adapter in ``slot`` at scale ``key[1]`` into the base weights (restoring first
        whatever else is merged); a no-op when ``key`` is merged already."""
        if self.key == key:
            return
        self.restore(wrappers)
        self.key = key  # before any write: restore() undoes a merge that fails half-way
        try:
            for name, wrapper in wrappers.items():
                if wrapper.slot_weights(slot) is not None:
                    self._merge_layer(name, wrapper, wrapper.slot_weights(slot), float(key[1]))
        except BaseException:
            self.restore(wrappers)
            raise
        self.merges += 1

    def _merge_layer(self, name: str, wrapper: nn.Module, held, scale: float) -> None:
        """``W += scale * sum_parts bt^T A_part`` on one layer (float32, one rounding), saving ``W`` first."""
        weight = dense_weight(wrapper)
        self._saved[name] = weight.detach().clone()
        merged = weight.detach().to(torch.float32)
        a = held.a.to(device=weight.device, dtype=torch.float32)
        for (h_start, rank, offset, size), bt in zip(held.parts, held.bt, strict=True):
            delta = bt.to(device=weight.device, dtype=torch.float32).t() @ a[h_start : h_start + rank]
            merged[offset : offset + size].add_(delta, alpha=scale)
        weight.copy_(merged)

    @torch.no_grad()
    def restore(self, wrappers: Mapping[str, nn.Module]) -> None:
        """Copy the saved base weights back (bitwise); a no-op when nothing is merged."""
        if self.key is None:
            return
        for name, saved in self._saved.items():
            dense_weight(wrappers[name]).copy_(saved)
        self._saved.clear()
        self.key = None
        self.in_use = False
        self.restores += 1


def single_adapter(reqs: list, scales: list, factors: list) -> tuple[int, float] | None:
    """``(lora_int_id, scale)`` when every sample of an activation has exactly one and the same adapter
    at one and the same constant non-zero scale with no block multipliers (what may be merged), else
    ``None`` (several adapters, mixed rows, a schedule, scale 0)."""
    firsts = {(s[0].lora_int_id, v[0]) if len(s) == 1 else None for s, v in zip(reqs, scales, strict=True)}
    if len(firsts) != 1 or any(f for sample in factors for f in sample):
        return None
    (only,) = firsts
    if only is None or isinstance(only[1], bool) or not isinstance(only[1], int | float) or only[1] == 0:
        return None
    return only
