"""``BaseLayerWithLoRA``: slot storage and the forward shared by every LoRA layer class.

A LoRA layer replaces a linear module in the denoiser, keeps the original as ``base_layer`` and adds
the LoRA update of every active device slot:

    y[n] = base(x)[n] + sum_j  lambda[n, j] * (s_j B_j) (A_j x[n])

where ``n`` is the sample (leading dimension of ``x``), ``j`` a device slot, ``lambda`` the
per-request scale matrix ``[batch, max_loras]`` published in the shared :class:`LoRABatchState`,
and the adapter scaling ``s_j`` (``lora_alpha / r``) is folded into ``B`` when the adapter is bound.

Slot storage: per device slot, the :class:`SlotWeights` of the adapter in that slot, cut to this
rank and laid out once when the adapter enters the host cache (:meth:`BaseLayerWithLoRA.prepare`).
When the LoRA device is the host (CPU models) a slot refers to the cached tensors, so writing an
adapter into a slot copies nothing; on an accelerator it is one host-to-device copy per tensor.

Each subclass owns its layer kind: ``can_replace_layer`` (which base layers it wraps),
``geometry_of`` (the output slices and tensor-parallel sharding of ``A`` / ``B``) and the hooks of
the shared :meth:`BaseLayerWithLoRA.forward` (input split, bias, collective). The delta is added
*before* the layer's collective: a row-parallel partial delta is summed by the all-reduce into
exactly ``B (A x)``; a column-parallel one is gathered with the output.

Exactness rules: a slot whose scale column is all zero is skipped; in a mixed batch only the row
runs with a non-zero scale are touched (views of ``x`` / ``y``, no gather / scatter), so a sample
whose adapters all have scale 0 gets bit-for-bit the base output; scale ``-lambda`` gives exactly
``-1`` times the ``+lambda`` delta.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn

from vllm_omni.diffusion.lora.banks import LoRABank
from vllm_omni.diffusion.lora.batch_state import LoRABatchState
from vllm_omni.diffusion.lora.geometry import LayerGeometry, tp_rank_and_size
from vllm_omni.diffusion.lora.ops import (
    add_lora,
    lora_expand,
    lora_shrink,
    row_scales,
    stack_slot_weights,
    stack_slot_weights_unscaled,
)
from vllm_omni.diffusion.lora.weights import LayerLoRAWeights, SlotWeights
from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.adapter_files import update_range_problem


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
    """Slot handling, delta computation and the shared forward; subclasses own their layer kind.

    Attributes not found on the layer are looked up on ``base_layer``, so model code that reads
    e.g. ``self.to_qkv.output_sizes`` or ``self.proj.weight`` keeps working after patching, and
    ``state_dict()`` / ``load_state_dict()`` keep the unpatched key names. ``named_parameters()``
    does show ``base_layer.``: load checkpoints through the model's loader *before* patching.

    The defaults of the forward hooks are those of a vLLM ``LinearBase`` layer run without
    collectives (``ReplicatedLinear``).
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
        self.geometry: LayerGeometry = self.geometry_of(base_layer)
        self.lora_state = state
        self.max_loras = int(max_loras)
        self.max_rank = int(max_rank)
        default_device, default_dtype = _default_device_dtype(base_layer)
        self.lora_device = torch.device(device) if device is not None else default_device
        self.lora_dtype = dtype or default_dtype
        self._slot_weights: list[SlotWeights | None] = [None] * self.max_loras
        #: the fixed-shape bank a compiled denoiser reads (:meth:`enable_bank`), else ``None``
        self.lora_bank: LoRABank | None = None
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

    # ------------------------------------------------------------ layer kind
    #: the layer kind this class wraps (instances of subclasses too, unless a more specific
    #: class earlier in the registry claims them); ``None``: none.
    source_layer_type: ClassVar[type[nn.Module] | None] = None

    @classmethod
    def can_replace_layer(cls, source_layer: nn.Module) -> bool:
        """Whether this class wraps ``source_layer`` (the registry asks the most specific first)."""
        return cls.source_layer_type is not None and isinstance(source_layer, cls.source_layer_type)

    @classmethod
    def geometry_of(cls, layer: nn.Module) -> LayerGeometry:
        """``layer``'s output slices and sharding on this rank.

        Raises:
            TypeError: the layer's output layout is not one this class supports.
        """
        raise TypeError(f"{cls.__name__} does not describe {type(layer).__name__}")

    # ----------------------------------------------------------------- slots
    def prepare(self, weights: LayerLoRAWeights) -> SlotWeights:
        """Cut one adapter's unsharded host weights to this rank and lay them out for the forward.

        Runs once per adapter when it enters the host cache, so that making it active later is a
        reference (same device and dtype) or one host-to-device copy per tensor, never a re-layout.
        The result lives on the host, in the layer's LoRA dtype (pinned when the LoRA device is CUDA).

        Raises:
            InvalidAdapterError: wrong number of slices, a LoRA rank above ``max_rank``, mismatched shapes,
                or an update not representable in the LoRA dtype
                (:func:`~vllm_omni.lora.adapter_files.update_range_problem`).
        """
        g = self.geometry
        if len(weights.slices) != len(g.slices):
            raise InvalidAdapterError(f"expected {len(g.slices)} output slices, got {len(weights.slices)}")
        for sl, pair in zip(g.slices, weights.slices, strict=True):
            if pair is None:
                continue
            lora_a, lora_b = pair
            if weights.rank_limited and lora_a.shape[0] > self.max_rank:
                raise InvalidAdapterError(f"LoRA rank {lora_a.shape[0]} exceeds max_rank {self.max_rank}")
            if lora_a.shape[1] != g.in_features or lora_b.shape[0] != sl.global_size:
                raise InvalidAdapterError(
                    f"LoRA shapes A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit a slice of "
                    f"{sl.global_size} rows x {g.in_features} inputs"
                )
            overflow = update_range_problem(lora_a, lora_b, 1.0, self.lora_dtype)  # lora_b is s*B
            if overflow:
                raise InvalidAdapterError(overflow)
        dtype = self.lora_dtype
        columns = slice(g.in_start, g.in_start + g.in_local)
        ranks = tuple(0 if pair is None else int(pair[0].shape[0]) for pair in weights.slices)
        present = [i for i, rank in enumerate(ranks) if rank]
        if not present:
            raise InvalidAdapterError("the adapter leaves every slice of this layer untouched")

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

        bias = self._local_bias(weights)
        return SlotWeights(
            host(a), parts, tuple(host(bt) for bt in bts), ranks, bool(weights.shared_a),
            None if bias is None else host(bias),
        )  # fmt: skip

    def _local_bias(self, weights: LayerLoRAWeights) -> torch.Tensor | None:
        """``s * b`` on this rank's local output rows (``[out_local]`` float32), or ``None``: no bias
        delta, or a row-parallel layer's rank other than 0 (the all-reduce sums the ranks' outputs)."""
        g = self.geometry
        if weights.biases is None or (g.kind == "row" and tp_rank_and_size(self.base_layer)[0] != 0):
            return None
        local = torch.zeros(g.out_local, dtype=torch.float32)
        for sl, bias in zip(g.slices, weights.biases, strict=True):
            if bias is not None:
                start, length = sl.rows_within_slice()
                local[sl.local_offset : sl.local_offset + length] = bias[start : start + length]
        return local

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
        if self.lora_bank is not None:
            self.lora_bank.write(slot, self._slot_weights[slot])

    def clear_slot(self, slot: int) -> None:
        """Forget ``slot`` on this layer."""
        self._slot_weights[slot] = None
        if self.lora_bank is not None:
            self.lora_bank.clear(slot)

    def enable_bank(self, table: torch.Tensor) -> LoRABank:
        """Give this layer a fixed-shape bank (what a compiled denoiser reads), filled from the slots.

        Args:
            table: the manager's shared scale table ``[groups, rows, max_loras]`` float32.

        Raises:
            TypeError: see :class:`~vllm_omni.diffusion.lora.banks.LoRABank`.
        """
        bank = LoRABank(
            self.geometry, self.max_loras, self.max_rank, table, self.lora_device, self.lora_dtype
        )
        self.lora_bank = bank
        for slot, held in enumerate(self._slot_weights):
            if held is not None:
                bank.write(slot, held)
        return bank

    # --------------------------------------------------------------- forward
    def has_active_lora(self) -> bool:
        """Whether an active slot holds weights for this layer."""
        held = self._slot_weights
        return any(held[act.slot] is not None for act in self.lora_state.slots_for(self)[0])

    def _stacked(self, slots) -> SlotWeights | None:
        held = [(self._slot_weights[a.slot], a.scale) for a in slots]
        return stack_slot_weights([(w, scale) for w, scale in held if w is not None])

    def _add_scheduled_stack(self, x: torch.Tensor, y: torch.Tensor, slots) -> bool:
        """The stacked path while scales change per step: stack once unscaled, scale ``h`` per step.

        Returns ``False`` when fewer than two slots hold weights for this layer.
        """
        state = self.lora_state
        owners = [a for a in slots if self._slot_weights[a.slot] is not None]
        key = (id(self), tuple(a.slot for a in owners))
        unit = state.unit_stacked.get(key)
        if unit is None:
            unit = stack_slot_weights_unscaled([self._slot_weights[a.slot] for a in owners])
            state.unit_stacked[key] = unit
        if unit is None:
            return False
        stacked, segments = unit
        scale = state.row_scales.get(id(self))
        if scale is None:
            scale = state.row_scales[id(self)] = row_scales(segments, [a.scale for a in owners], stacked.a)
        h = lora_shrink(x.reshape(-1, x.shape[-1]), stacked.a)
        lora_expand(h.mul_(scale), y, stacked.parts, stacked.bt)
        return True

    def apply_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add the active slots' deltas to ``y`` in place and return it.

        When several slots apply to every row with one scale each, they run stacked (one shrink,
        one expand per output range; built on the first forward of an activation, see
        :func:`.ops.stack_slot_weights`); otherwise slot by slot over its row runs. While a scale
        schedule re-publishes scales at each step, the stack is built once without scales and each
        step multiplies ``h`` by its row scales (:func:`.ops.stack_slot_weights_unscaled`).

        Args:
            x: layer input on this rank, ``[..., in_local]``; its leading dimension is the sample
                dimension whenever the batch mixes scales.
            y: layer output on this rank before any collective, ``[..., out_local]``.

        Raises:
            RuntimeError: the batch mixes adapter sets / scales but ``x.shape[0]`` is neither the
                batch size set by the manager nor explained by the forward context's row layout.
        """
        state = self.lora_state
        slots, uniform = state.slots_for(self)
        if uniform and state.on_step is not None:
            if self._add_scheduled_stack(x, y, slots):
                return self._add_biases(x, y, slots)
        elif uniform:
            key = id(self)
            if key not in state.stacked:
                state.stacked[key] = self._stacked(slots)
            stacked = state.stacked[key]
            if stacked is not None:
                add_lora(x, y, stacked, None)
                return self._add_biases(x, y, slots)
        for act in slots:
            w = self._slot_weights[act.slot]
            if w is None:
                continue
            act = state.for_rows(act, x.shape[0])
            if act.runs is None:
                add_lora(x, y, w, act.scale)
                continue
            for start, length, scale in act.runs:
                add_lora(x.narrow(0, start, length), y.narrow(0, start, length), w, scale)
        return self._add_biases(x, y, slots)

    def _add_biases(self, x: torch.Tensor, y: torch.Tensor, slots) -> torch.Tensor:
        """``y[rows] += lambda * bias`` of every active slot with a bias delta, over the rows it applies to."""
        for act in slots:
            w = self._slot_weights[act.slot]
            if w is None or w.bias is None:
                continue
            act = self.lora_state.for_rows(act, x.shape[0])
            runs = ((0, y.shape[0], act.scale),) if act.runs is None else act.runs
            for start, length, scale in runs:
                if scale is not None and scale != 0.0:
                    y.narrow(0, start, length).add_(w.bias.to(y.dtype), alpha=scale)
        return y

    def forward(self, x: torch.Tensor):
        """The base layer's forward with the active LoRA deltas added before its collective.

        Returns what the base layer returns (a tensor, or ``(output, bias)`` for a vLLM layer).
        While dynamo traces a compiled region the layer reads its bank instead of its slots
        (:meth:`_banked_forward`), so the traced graph never depends on which adapters are active.
        """
        if torch.compiler.is_compiling():
            return self._banked_forward(x)
        if not self.has_active_lora():
            return self.base_layer(x)
        x = self._local_input(x)
        return self._finish(self.apply_lora(x, self._base_output(x)))

    def _banked_forward(self, x: torch.Tensor):
        """The compiled-region forward: the base layer alone while no adapter is active in the batch
        (one graph), else the base output plus the bank's delta (one other graph).

        Raises:
            RuntimeError: the layer is traced without a bank (the manager was built with ``banks=False``).
        """
        if not self.lora_state.bank_on:
            return self.base_layer(x)
        if self.lora_bank is None:
            raise RuntimeError(
                f"{type(self).__name__} is being compiled with LoRA active but has no bank; build the "
                "DiffusionLoRAManager with banks=True before compiling the denoiser"
            )
        x = self._local_input(x)
        return self._finish(self.lora_bank.add_delta(x, self._base_output(x)))

    def _local_input(self, x: torch.Tensor) -> torch.Tensor:
        """The part of ``x`` this rank multiplies (row-parallel layers split it)."""
        return x

    def _bias(self) -> torch.Tensor | None:
        """The bias added by this rank's GEMM."""
        base = self.base_layer
        return None if base.skip_bias_add else base.bias

    def _base_output(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's base output, before any collective."""
        base = self.base_layer
        return base.quant_method.apply(base, x, self._bias())

    def _collect(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's collective over ranks (none by default)."""
        return out

    def _finish(self, out: torch.Tensor):
        """Collect and return in the base layer's convention (``return_bias``)."""
        base = self.base_layer
        out = self._collect(out)
        if not base.return_bias:
            return out
        return out, (base.bias if base.skip_bias_add else None)

    def extra_repr(self) -> str:
        g = self.geometry
        return f"max_loras={self.max_loras}, max_rank={self.max_rank}, slices={len(g.slices)}, kind={g.kind}"
