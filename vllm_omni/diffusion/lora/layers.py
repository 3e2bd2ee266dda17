"""LoRA wrappers for vLLM linear layers and ``torch.nn.Linear``.

A wrapper replaces a linear module in the denoiser, keeps the original as ``base_layer`` and adds
the LoRA update of every active device slot:

    y[n] = base(x)[n] + sum_j  lambda[n, j] * (s_j B_j) (A_j x[n])

where ``n`` is the sample (leading dimension of ``x``), ``j`` a device slot, ``lambda`` the
per-request scale matrix ``[batch, max_loras]`` held in the shared :class:`LoRABatchState`, and the
adapter scaling ``s_j`` (``lora_alpha / r``) is folded into ``B`` when the adapter is loaded.

Slot storage: every wrapper keeps, per device slot, the :class:`SlotWeights` of the adapter in
that slot: ``A`` of all parts stacked ``[sum r, in_local]`` and ``(s B)^T`` per output part
``[r, out_part]``, cut to this rank and laid out once when the adapter enters the host cache
(:meth:`BaseLayerWithLoRA.prepare`). When the LoRA device is the host (CPU models) a slot refers
to the cached tensors, so writing an adapter into a slot copies nothing; on an accelerator it is
one host-to-device copy per tensor. A packed layer (``to_qkv``, ``w13``) may receive separate
adapters for each sub-layer; the shrink ``h = x A^T`` is still one GEMM for all of them.

Sharding follows :mod:`.geometry`. Row-parallel layers add their partial delta *before* the layer's
all-reduce, so the sum over ranks is exactly ``B (A x)``; column-parallel layers add before the
optional all-gather.

Exactness rules: a slot whose scale column is all zero is skipped; in a mixed batch only the rows
with a non-zero scale are touched (``index_add_``), so a sample whose adapters all have scale 0 gets
bit-for-bit the base output; scale ``-lambda`` gives exactly ``-1`` times the ``+lambda`` delta.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from vllm_omni.diffusion.lora.geometry import LayerGeometry, layer_geometry


@dataclass(frozen=True)
class SlotActivation:
    """How one device slot applies to the current batch.

    Attributes:
        slot: device slot index.
        rows: int64 device tensor of the sample indices with a non-zero scale, or ``None`` for all.
        scale: the common scale of those samples when they share one, else ``None``.
        row_scales: float32 device tensor ``[len(rows)]`` (or ``[batch]``) of per-sample scales when
            they differ, else ``None``.
    """

    slot: int
    rows: torch.Tensor | None
    scale: float | None
    row_scales: torch.Tensor | None
    column: tuple[float, ...] = field(default=(), compare=False)
    #: the same rows as host-side ``(start, length, scale)`` runs of consecutive rows sharing a
    #: scale (``None``: every row, scale ``scale``); the forward works on these views, so a
    #: mixed batch needs no gather / scatter and no device index tensors.
    runs: tuple[tuple[int, int, float], ...] | None = field(default=None, compare=False)


def scale_runs(
    values: Sequence[float], lengths: Sequence[int] | None = None
) -> tuple[tuple[int, int, float], ...]:
    """``(start, length, scale)`` runs of the rows with a non-zero scale.

    ``values`` holds one scale per sample; ``lengths`` (optional) the number of rows of each sample
    (default one). Consecutive samples with the same scale are merged into one run.
    """
    runs: list[tuple[int, int, float]] = []
    start = 0
    for n, value in enumerate(values):
        length = 1 if lengths is None else int(lengths[n])
        if value != 0.0 and length:
            if runs and runs[-1][2] == value and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + length, value)
            else:
                runs.append((start, length, float(value)))
        start += length
    return tuple(runs)


_ROW_LAYOUT = threading.local()


@contextmanager
def lora_rows_per_sample(lengths: Sequence[int]) -> Iterator[None]:
    """Declare that layer inputs inside this block concatenate the samples' rows.

    Models that run a layer on ragged, concatenated tokens (``[sum(lengths), d]`` instead of
    ``[batch, ...]``, e.g. patch / caption embedders) wrap that call so a mixed LoRA batch knows
    which rows belong to which sample::

        with lora_rows_per_sample([f.shape[0] for f in feats]):
            x = embedder(torch.cat(feats))

    Only consulted when the leading dimension differs from the batch size; costs nothing otherwise.
    """
    previous = getattr(_ROW_LAYOUT, "lengths", None)
    _ROW_LAYOUT.lengths = tuple(int(n) for n in lengths)
    try:
        yield
    finally:
        _ROW_LAYOUT.lengths = previous


class LoRABatchState:
    """Activation shared by every wrapper of one manager (set by the manager, read in forward)."""

    def __init__(self) -> None:
        self.batch_size: int = 0
        self.slots: tuple[SlotActivation, ...] = ()
        self._ragged: dict[tuple[int, tuple[int, ...]], SlotActivation] = {}
        #: per layer, the active adapters stacked into one SlotWeights (see
        #: BaseLayerWithLoRA._stacked); built on first use, dropped with the activation.
        self.stacked: dict[int, SlotWeights | None] = {}
        self.uniform = False

    def set(self, batch_size: int, slots: tuple[SlotActivation, ...]) -> None:
        self.batch_size = batch_size
        self.slots = slots
        self._ragged = {}
        self.stacked = {}
        # every active slot applies to every row with one scale: the layers may stack them
        self.uniform = len(slots) > 1 and all(
            a.runs is None and a.rows is None and a.row_scales is None and a.scale is not None for a in slots
        )

    def clear(self) -> None:
        self.set(0, ())

    def for_rows(self, act: SlotActivation, leading: int) -> SlotActivation:
        """``act`` re-expressed for an input whose leading dimension is ``leading``.

        Raises:
            RuntimeError: per-sample scales differ but the rows cannot be attributed to samples.
        """
        if act.rows is None and act.row_scales is None:
            return act
        if leading == self.batch_size:
            return act
        lengths = getattr(_ROW_LAYOUT, "lengths", None)
        if lengths is None or len(lengths) != self.batch_size or sum(lengths) != leading:
            raise RuntimeError(
                f"LoRA batch mixes adapter scales across {self.batch_size} samples but this layer got input "
                f"with leading dimension {leading}; pass one entry per sample of the forward batch, or wrap "
                "ragged inputs in lora_rows_per_sample(lengths)"
            )
        key = (act.slot, lengths)
        cached = self._ragged.get(key)
        if cached is None:
            device = act.rows.device if act.rows is not None else act.row_scales.device
            rows: list[int] = []
            scales: list[float] = []
            start = 0
            for length, value in zip(lengths, act.column, strict=True):
                if value != 0.0:
                    rows.extend(range(start, start + length))
                    scales.extend([value] * length)
                start += length
            index = torch.tensor(rows, dtype=torch.long).to(device)
            per_row = None if act.scale is not None else torch.tensor(scales, dtype=torch.float32).to(device)
            runs = scale_runs(act.column, lengths)
            cached = SlotActivation(act.slot, index, act.scale, per_row, act.column, runs)
            self._ragged[key] = cached
        return cached


@dataclass(frozen=True)
class LayerLoRAWeights:
    """One adapter's weights for one (possibly packed) layer, unsharded, on the host.

    Attributes:
        slices: per output slice of the layer, ``(A [r, d_in], s*B [slice_rows, r])`` float32, or
            ``None`` when the adapter leaves that slice untouched (it then stays exactly zero).
        shared_a: every present slice uses the same ``A`` (the adapter targeted the packed layer by
            its own name); the forward then computes ``A x`` once.
    """

    slices: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    shared_a: bool = False

    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in filter(None, self.slices)
        )


@dataclass(frozen=True)
class SlotWeights:
    """One adapter's LoRA for one layer on this rank, laid out for the forward pass.

    Built once by :meth:`BaseLayerWithLoRA.prepare` when the adapter enters the host cache.

    Attributes:
        a: ``[sum of the parts' ranks, in_local]``: the ``A`` rows of every part stacked, so one
            GEMM ``h = x a^T`` serves all parts (a shared ``A`` appears once).
        parts: per part ``(h_start, rank, out_offset, out_size)``: columns ``h[:, h_start:h_start +
            rank]`` update the local output columns ``out_offset:out_offset + out_size``.
        bt: per part ``(s B_local)^T``, ``[rank, out_size]``, contiguous (the ``addmm_`` operand).
        ranks: rank per output slice of the layer (``0``: the slice is left alone).
        shared_a: the adapter targeted the packed layer by its own name (one ``A`` for all slices).
    """

    a: torch.Tensor
    parts: tuple[tuple[int, int, int, int], ...]
    bt: tuple[torch.Tensor, ...]
    ranks: tuple[int, ...]
    shared_a: bool = False

    def to(self, device: torch.device, dtype: torch.dtype) -> SlotWeights:
        """These weights on ``device`` in ``dtype``; ``self`` (no copy) when already there."""
        tensors = (self.a, *self.bt)
        if all(t.device == device and t.dtype == dtype for t in tensors):
            return self
        moved = [t.to(device=device, dtype=dtype, non_blocking=True) for t in tensors]
        return SlotWeights(moved[0], self.parts, tuple(moved[1:]), self.ranks, self.shared_a)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.a, *self.bt)


def _default_device_dtype(layer: nn.Module) -> tuple[torch.device, torch.dtype]:
    dtype = getattr(layer, "params_dtype", None)
    device = torch.device("cpu")
    for p in layer.parameters(recurse=False):
        device = p.device
        if dtype is None and p.is_floating_point():
            dtype = p.dtype
        break
    return device, dtype or torch.get_default_dtype()


def _hide_base_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    inner = prefix + "base_layer."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _restore_base_prefix(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    for name, _ in module.base_layer.named_parameters():
        key = prefix + name
        if key in state_dict:
            state_dict[prefix + "base_layer." + name] = state_dict.pop(key)


class BaseLayerWithLoRA(nn.Module):
    """Common buffer handling and delta computation; subclasses define ``forward``.

    Attributes not found on the wrapper are looked up on ``base_layer``, so model code that reads
    e.g. ``self.to_qkv.output_sizes`` or ``self.proj.weight`` keeps working after patching, and
    ``state_dict()`` / ``load_state_dict()`` keep the unpatched key names. ``named_parameters()``
    does show ``base_layer.``: load checkpoints through the model's loader *before* patching.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        state: LoRABatchState,
        max_loras: int,
        max_rank: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.geometry: LayerGeometry = layer_geometry(base_layer)
        self.lora_state = state
        self.max_loras = int(max_loras)
        self.max_rank = int(max_rank)
        default_device, default_dtype = _default_device_dtype(base_layer)
        self.lora_device = torch.device(device) if device is not None else default_device
        self.lora_dtype = dtype or default_dtype
        self._slot_weights: list[SlotWeights | None] = [None] * self.max_loras
        # Keep checkpoint names stable: "<layer>.weight", not "<layer>.base_layer.weight".
        self.register_state_dict_post_hook(_hide_base_prefix)
        self.register_load_state_dict_pre_hook(_restore_base_prefix)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("base_layer", "_modules", "_parameters", "_buffers"):
                raise
            return getattr(super().__getattr__("base_layer"), name)

    # ----------------------------------------------------------------- slots
    def prepare(self, weights: LayerLoRAWeights) -> SlotWeights:
        """Cut one adapter's unsharded host weights to this rank and lay them out for the forward.

        Runs once per adapter when it enters the host cache, so that making it active later is a
        reference (same device and dtype) or one host-to-device copy per tensor, never a re-layout.
        The result lives on the host, in the layer's LoRA dtype (pinned when the LoRA device is CUDA).

        Raises:
            ValueError: wrong number of slices, a rank above ``max_rank``, or mismatched shapes.
        """
        g = self.geometry
        if len(weights.slices) != len(g.slices):
            raise ValueError(f"expected {len(g.slices)} output slices, got {len(weights.slices)}")
        for sl, pair in zip(g.slices, weights.slices, strict=True):
            if pair is None:
                continue
            lora_a, lora_b = pair
            if lora_a.shape[0] > self.max_rank:
                raise ValueError(f"LoRA rank {lora_a.shape[0]} exceeds max_rank {self.max_rank}")
            if lora_a.shape[1] != g.in_features or lora_b.shape[0] != sl.global_size:
                raise ValueError(
                    f"LoRA shapes A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit a slice of "
                    f"{sl.global_size} rows x {g.in_features} inputs"
                )
        dtype = self.lora_dtype
        columns = slice(g.in_start, g.in_start + g.in_local)
        ranks = tuple(0 if pair is None else int(pair[0].shape[0]) for pair in weights.slices)
        present = [i for i, rank in enumerate(ranks) if rank]
        if not present:
            raise ValueError("the adapter leaves every slice of this layer untouched")

        def local_b(index: int) -> torch.Tensor:
            start, length = g.slices[index].rows_within_slice()
            return weights.slices[index][1][start : start + length]

        contiguous = all(  # the present slices tile the local output in order
            g.slices[i].local_offset
            == (g.slices[i - 1].local_offset + g.slices[i - 1].local_size if i else 0)
            for i in range(len(g.slices))
        ) and present == list(range(len(g.slices)))
        if weights.shared_a and contiguous:
            a = weights.slices[0][0][:, columns]
            b = torch.cat([local_b(i) for i in present]) if len(present) > 1 else local_b(present[0])
            parts = ((0, ranks[0], 0, g.out_local),)
            bts = (b.t(),)
        else:
            shared = weights.shared_a
            a = (
                weights.slices[present[0]][0][:, columns]
                if shared
                else torch.cat([weights.slices[i][0][:, columns] for i in present])
            )
            parts_list, bts_list, h_start = [], [], 0
            for i in present:
                sl = g.slices[i]
                parts_list.append((0 if shared else h_start, ranks[i], sl.local_offset, sl.local_size))
                bts_list.append(local_b(i).t())
                h_start += 0 if shared else ranks[i]
            parts, bts = tuple(parts_list), tuple(bts_list)
        pin = self.lora_device.type == "cuda"

        def host(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device="cpu", dtype=dtype).contiguous()
            return t.pin_memory() if pin else t

        return SlotWeights(host(a), parts, tuple(host(bt) for bt in bts), ranks, bool(weights.shared_a))

    def slot_ranks(self, slot: int) -> tuple[int, ...] | None:
        """Per-slice ranks written into ``slot`` (``None`` when the slot leaves this layer alone)."""
        held = self._slot_weights[slot]
        return None if held is None else held.ranks

    def slot_weights(self, slot: int) -> SlotWeights | None:
        """What ``slot`` holds for this layer (on the LoRA device), or ``None``."""
        return self._slot_weights[slot]

    def set_slot(self, slot: int, weights: SlotWeights | LayerLoRAWeights | None) -> None:
        """Make ``slot`` hold one adapter's weights (``None`` clears it).

        ``weights`` is what :meth:`prepare` returned (or unsharded weights, prepared here). When the
        LoRA device and dtype are those of the prepared host tensors (a CPU model) the slot refers to
        them without copying; otherwise each tensor is copied to the device once (asynchronously from
        pinned memory).

        Raises:
            ValueError: see :meth:`prepare`.
        """
        if weights is None:
            self.clear_slot(slot)
            return
        if isinstance(weights, LayerLoRAWeights):
            weights = self.prepare(weights)
        self._slot_weights[slot] = weights.to(self.lora_device, self.lora_dtype)

    def clear_slot(self, slot: int) -> None:
        """Forget ``slot`` on this layer."""
        self._slot_weights[slot] = None

    # --------------------------------------------------------------- forward
    def has_active_lora(self) -> bool:
        held = self._slot_weights
        return any(held[act.slot] is not None for act in self.lora_state.slots)

    def _lora_rows(self, x: torch.Tensor, y: torch.Tensor, w: SlotWeights, scale: float | None) -> None:
        """Add ``scale * B (A x)`` of one slot to ``y`` (same leading shape as ``x``) in place.

        One GEMM computes ``h = x A^T`` for every part at once (the A rows are stacked); each part
        then updates its output columns with ``addmm_`` when ``y`` is contiguous and of the LoRA
        dtype (no delta tensor, no extra pass over the output); otherwise the delta is added.
        """
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != w.a.dtype:
            x2 = x2.to(w.a.dtype)
        h = F.linear(x2, w.a)
        if scale is not None and scale != 1.0:
            h.mul_(scale)
        y2 = y.view(-1, y.shape[-1]) if (y.is_contiguous() and y.dtype == w.a.dtype) else None
        whole_h = len(w.parts) == 1 and w.parts[0][1] == h.shape[-1]
        for (h_start, rank, offset, size), bt in zip(w.parts, w.bt, strict=True):
            hp = h if whole_h else h.narrow(-1, h_start, rank)
            if y2 is not None:
                target = y2 if (offset == 0 and size == y2.shape[-1]) else y2.narrow(-1, offset, size)
                target.addmm_(hp, bt)
                continue
            delta = (hp @ bt).view(*x.shape[:-1], -1).to(y.dtype)
            target = y if (offset == 0 and size == y.shape[-1]) else y.narrow(-1, offset, size)
            target.add_(delta)

    def _stacked(self) -> SlotWeights | None:
        """The active slots as one :class:`SlotWeights`, scales folded into ``A`` (``None``: fewer than 2).

        Used when every active slot applies to every row with one scale (a request composing K
        adapters): then ``sum_j lambda_j B_j A_j x`` is one shrink GEMM over all adapters' ``A``
        rows and one ``addmm_`` per output part over all their ``B`` columns, so the input and the
        output are each passed over once instead of K times. Parts are grouped by the output columns
        they update. Costs a copy of the active adapters' weights for this layer, built on the first
        forward of an activation and dropped with it.
        """
        held = [(self._slot_weights[a.slot], a.scale) for a in self.lora_state.slots]
        held = [(w, scale) for w, scale in held if w is not None]
        if len(held) < 2:
            return None
        groups: dict[tuple[int, int], list[tuple[torch.Tensor, float, torch.Tensor]]] = {}
        for w, scale in held:
            for (h_start, rank, offset, size), bt in zip(w.parts, w.bt, strict=True):
                groups.setdefault((offset, size), []).append((w.a[h_start : h_start + rank], scale, bt))
        rows: list[torch.Tensor] = []
        parts: list[tuple[int, int, int, int]] = []
        bts: list[torch.Tensor] = []
        start = 0
        for (offset, size), items in groups.items():
            rank = sum(a.shape[0] for a, _, _ in items)
            rows += [a if scale == 1.0 else a * scale for a, scale, _ in items]
            bts.append(torch.cat([bt for _, _, bt in items]) if len(items) > 1 else items[0][2])
            parts.append((start, rank, offset, size))
            start += rank
        return SlotWeights(torch.cat(rows), tuple(parts), tuple(bts), ranks=(), shared_a=False)

    def apply_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add the active slots' deltas to ``y`` in place and return it.

        Args:
            x: layer input on this rank, ``[..., in_local]``; its leading dimension is the sample
                dimension whenever the batch mixes scales.
            y: layer output on this rank before any collective, ``[..., out_local]``.

        Raises:
            RuntimeError: the batch mixes adapter sets / scales but ``x.shape[0]`` is neither the
                batch size set by the manager nor explained by :func:`lora_rows_per_sample`.
        """
        state = self.lora_state
        if state.uniform:
            key = id(self)
            if key not in state.stacked:
                state.stacked[key] = self._stacked()
            stacked = state.stacked[key]
            if stacked is not None:
                self._lora_rows(x, y, stacked, None)
                return y
        for act in state.slots:
            w = self._slot_weights[act.slot]
            if w is None:
                continue
            act = state.for_rows(act, x.shape[0])
            runs = act.runs
            if runs is None and (act.rows is not None or act.row_scales is not None):
                runs = scale_runs(act.column)  # built by hand without runs: derive them
            if runs is None:
                self._lora_rows(x, y, w, act.scale)
                continue
            for start, length, scale in runs:
                self._lora_rows(x.narrow(0, start, length), y.narrow(0, start, length), w, scale)
        return y

    def extra_repr(self) -> str:
        g = self.geometry
        return f"max_loras={self.max_loras}, max_rank={self.max_rank}, slices={len(g.slices)}, kind={g.kind}"


class LinearWithLoRA(BaseLayerWithLoRA):
    """``torch.nn.Linear`` (the diffusers fallback path). Returns a tensor, like the base layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.has_active_lora():
            return self.base_layer(x)
        base = self.base_layer
        return self.apply_lora(x, F.linear(x, base.weight, base.bias))


class ReplicatedLinearWithLoRA(BaseLayerWithLoRA):
    """vLLM ``ReplicatedLinear`` (e.g. adaLN modulation); full ``A`` and ``B`` on every rank."""

    def forward(self, x: torch.Tensor):
        base = self.base_layer
        if not self.has_active_lora():
            return base(x)
        bias = base.bias if not base.skip_bias_add else None
        out = self.apply_lora(x, base.quant_method.apply(base, x, bias))
        if not base.return_bias:
            return out
        return out, (base.bias if base.skip_bias_add else None)


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):
    """vLLM ``ColumnParallelLinear``: ``B`` sharded by output rows; delta added before the all-gather."""

    def forward(self, x: torch.Tensor):
        base = self.base_layer
        if not self.has_active_lora():
            return base(x)
        from vllm.distributed import tensor_model_parallel_all_gather

        bias = base.bias if not base.skip_bias_add else None
        out = self.apply_lora(x, base.quant_method.apply(base, x, bias))
        if base.gather_output and base.tp_size > 1:
            out = tensor_model_parallel_all_gather(out)
        if not base.return_bias:
            return out
        return out, (base.bias if base.skip_bias_add else None)


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """vLLM ``MergedColumnParallelLinear`` (e.g. ``w13``): one output slice per ``output_sizes`` entry."""


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """vLLM ``QKVParallelLinear`` (``to_qkv``): q / k / v output slices, GQA sizes and KV replicas honoured."""


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    """vLLM ``RowParallelLinear``: ``A`` sharded by input columns; partial delta added before the all-reduce."""

    def forward(self, x: torch.Tensor):
        base = self.base_layer
        if not self.has_active_lora():
            return base(x)
        from vllm.distributed import split_tensor_along_last_dim, tensor_model_parallel_all_reduce

        if base.input_is_parallel:
            x_local = x
        else:
            x_local = split_tensor_along_last_dim(x, num_partitions=base.tp_size)[base.tp_rank].contiguous()
        bias = None if (base.tp_rank > 0 or base.skip_bias_add) else base.bias
        out = self.apply_lora(x_local, base.quant_method.apply(base, x_local, bias))
        if base.reduce_results and base.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        if not base.return_bias:
            return out
        return out, (base.bias if base.skip_bias_add else None)


def wrapper_class_for(module: nn.Module) -> type[BaseLayerWithLoRA] | None:
    """The wrapper class for ``module``, or ``None`` when it is not a supported linear layer."""
    if isinstance(module, BaseLayerWithLoRA):
        return None
    if isinstance(module, QKVParallelLinear):
        return QKVParallelLinearWithLoRA
    if isinstance(module, MergedColumnParallelLinear):
        return MergedColumnParallelLinearWithLoRA
    if isinstance(module, ColumnParallelLinear):
        return ColumnParallelLinearWithLoRA
    if isinstance(module, RowParallelLinear):
        return RowParallelLinearWithLoRA
    if isinstance(module, ReplicatedLinear):
        return ReplicatedLinearWithLoRA
    if isinstance(module, nn.Linear):
        return LinearWithLoRA
    return None
