"""``DiffusionLoRAManager``: request-time LoRA for diffusion denoisers (the PEFT backend).

Lifecycle:

1. Construction walks ``named_modules()`` of the denoiser(s) and replaces every supported linear
   layer (vLLM ``ReplicatedLinear`` / ``ColumnParallelLinear`` / ``RowParallelLinear`` /
   ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` and ``torch.nn.Linear``) by its LoRA layer
   class from :mod:`.layers`. Packed layers are described by the model's ``stacked_params_mapping``.
2. :meth:`DiffusionLoRAManager.add_lora` reads an adapter into the host LRU cache (``max_cpu_loras``
   entries), checks it against the layers and stores it cut to this rank and laid out for the
   forward (:class:`~.weights.SlotWeights`, in the LoRA dtype).
3. :meth:`DiffusionLoRAManager.set_active_adapters` (or the :meth:`activate` context manager) puts
   the batch's adapters into the ``max_loras`` device slots (reusing slots that already hold them;
   on a CPU model a slot refers to the cached tensors, elsewhere they are copied to the device)
   and publishes the per-sample scale matrix ``[batch, max_loras]`` that every wrapper reads. A
   scale may be a :class:`~vllm_omni.lora.schedule.LoRAScaleSchedule`: its block multipliers are
   resolved once per activation into per-layer activations, and its per-step scales are published
   again at each denoising step the forward context reports (slot contents never change).

Rules: pinned adapters are never evicted; adapters held by in-flight requests (:meth:`activate`,
:meth:`acquire_loras`) or by the current activation are neither evicted nor removable; a failed load
leaves the cache and slots as they were; argument errors are raised before any work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn

from vllm_omni.diffusion.lora.activation import check_request, validate_activation
from vllm_omni.diffusion.lora.banks import DEFAULT_BANK_ROWS, LoRABankSet
from vllm_omni.diffusion.lora.batch_state import LoRABatchState, SlotActivation, scale_runs
from vllm_omni.diffusion.lora.cache import AdapterCache, CacheEntry, SlotTable
from vllm_omni.diffusion.lora.formats.text_encoders import text_encoder_parts_refusal
from vllm_omni.diffusion.lora.layers import BaseLayerWithLoRA
from vllm_omni.diffusion.lora.loading import load_lora_adapter
from vllm_omni.diffusion.lora.merge import MergedWeights, single_adapter
from vllm_omni.diffusion.lora.targets import (
    DEFAULT_DENOISER_ATTRS,
    StackedParamsMapping,
    TargetIndex,
    bind_adapter,
    find_denoisers,
    mapping_from_models,
)
from vllm_omni.diffusion.lora.tensor_adapter import adapter_from_tensors
from vllm_omni.errors import ConfigError, InvalidRequestError, LoRACacheError, LoRAFormatError
from vllm_omni.lora.request import LoRARequest, RequestAdapters
from vllm_omni.lora.schedule import LoRAScaleSchedule
from vllm_omni.lora.tensor_request import TensorLoRARequest

#: Names of a denoiser's main block list, tried in order when it declares no ``lora_block_list``.
BLOCK_LIST_NAMES: tuple[str, ...] = ("transformer_blocks", "layers", "blocks")


class DiffusionLoRAManager:
    """Multi-LoRA runtime for one diffusion stage worker.

    Args:
        model_or_pipeline: a denoiser ``nn.Module`` or a pipeline exposing ``transformer`` (and
            optionally ``transformer_2``); see :func:`find_denoisers`.
        max_loras: device slots; also the most adapters one batch (and one request) may use.
        max_rank: largest LoRA rank accepted (adapters above it are refused when loaded).
        max_cpu_loras: host LRU capacity (defaults to ``max_loras``; must be ``>= max_loras``).
        device, dtype: where the slots' A and B live and their dtype (default: each base layer's own).
        stacked_params_mapping: ``(packed_name, sub_name, shard_id)`` tuples; defaults to the union
            of the denoisers' ``stacked_params_mapping`` attributes.
        target_modules: optional layer-name suffixes to patch (default: every supported linear).
        denoiser_attrs: pipeline attributes searched for denoisers.
        adapter_loader: ``path -> LoRAAdapterWeights`` (default :func:`.loading.load_lora_adapter`).
        banks: also keep every slot in fixed-shape banks (:mod:`.banks`), what a compiled denoiser
            reads; adapters whose (LoRA-equivalent) rank exceeds ``max_rank`` are then refused.
        bank_rows: denoiser rows one activation may hold in bank mode.
        merge: the merged fast path (:mod:`.merge`): an activation of one adapter at one constant
            scale on every row is folded into the base weights, restored bitwise when anything else runs.

    Raises:
        ConfigError: bad sizes, or a mapping entry naming a shard the packed layer lacks.
        ValueError: a layer is already wrapped by another manager.
    """

    def __init__(
        self,
        model_or_pipeline: object,
        *,
        max_loras: int = 1,
        max_rank: int = 64,
        max_cpu_loras: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        stacked_params_mapping: StackedParamsMapping | None = None,
        target_modules: Sequence[str] | None = None,
        denoiser_attrs: Sequence[str] = DEFAULT_DENOISER_ATTRS,
        adapter_loader: Callable[[str], object] | None = None,
        banks: bool = False,
        bank_rows: int = DEFAULT_BANK_ROWS,
        merge: bool = False,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ConfigError(f"max_loras and max_rank must be >= 1, got {max_loras} and {max_rank}")
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_cpu_loras < max_loras:
            raise ConfigError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.max_loras = int(max_loras)
        self.max_rank = int(max_rank)
        self.max_cpu_loras = int(max_cpu_loras)
        self.denoisers = find_denoisers(model_or_pipeline, denoiser_attrs)
        if stacked_params_mapping is None:
            stacked_params_mapping = mapping_from_models(self.denoisers)
        self.stacked_params_mapping = list(stacked_params_mapping)
        self._index = TargetIndex(self.denoisers, self.stacked_params_mapping, target_modules)
        self._state = LoRABatchState()
        self._loader = adapter_loader or load_lora_adapter
        self._cache = AdapterCache(self.max_cpu_loras)
        self._slots = SlotTable(self.max_loras)
        self._lock = threading.RLock()
        self._active_ids: tuple[int, ...] = ()
        self._active_key: tuple | None = None
        self.scale_matrix: torch.Tensor | None = None
        self.slot_writes = 0
        self._block_cache: dict[tuple, dict[str, float]] = {}
        self._slot_layers: list[tuple[str, ...]] = [()] * self.max_loras
        self.wrappers: dict[str, BaseLayerWithLoRA] = {}
        for name, target in self._index.targets.items():
            current = getattr(target.parent, target.attr)
            if isinstance(current, BaseLayerWithLoRA):
                raise ValueError(f"layer {name!r} is already wrapped by another LoRA manager")
            wrapper = target.layer_cls(
                target.module, self._state, self.max_loras, self.max_rank, device, dtype
            )
            setattr(target.parent, target.attr, wrapper)
            self.wrappers[name] = wrapper
        self.banks = LoRABankSet(self.wrappers, self.max_loras, bank_rows) if banks else None
        #: the merged fast path (:mod:`.merge`), ``None`` when off
        self.merged = MergedWeights() if merge else None
        for module in self.denoisers.values() if merge else ():
            module.register_forward_pre_hook(self._restore_unless_merged_in_use)

    # ------------------------------------------------------------------ cache
    def list_loras(self) -> list[int]:
        """Ids in the host cache, least recently used first."""
        with self._lock:
            return self._cache.ids()

    def slot_assignment(self) -> dict[int, int]:
        """Adapter id -> device slot for adapters currently resident on the device."""
        with self._lock:
            return self._slots.mapping()

    def cache_entry(self, lora_int_id: int) -> CacheEntry | None:
        """The host cache entry (pinned flag, refcount, path), or ``None``."""
        return self._cache.get(lora_int_id)

    def cached_nbytes(self, lora_int_id: int | None = None) -> int:
        """Host bytes held by one cached adapter's prepared slot weights (all of them for ``None``).

        LoHa / LoKr adapters count their LoRA-equivalent or dense factors, as stored. Raises
        ``KeyError`` for an id that is not cached.
        """
        with self._lock:
            ids = self._cache.ids() if lora_int_id is None else [lora_int_id]
            entries = [self._cache.get(i) for i in ids]
            if None in entries:
                raise KeyError(f"LoRA {lora_int_id} is not cached")
            return sum(e.meta.get("nbytes", 0) for e in entries)

    def _load_entry(self, request: LoRARequest) -> CacheEntry:
        lora_id, path = check_request(request)
        adapter = (
            adapter_from_tensors(request) if isinstance(request, TensorLoRARequest) else self._loader(path)
        )
        if getattr(adapter, "text_encoders", None):  # never ignored silently (a stage applies them itself)
            why = "this LoRA manager patches the denoiser only"
            raise LoRAFormatError(text_encoder_parts_refusal(adapter, why))
        bound = bind_adapter(adapter, self._index, self.max_rank)
        prepared = {}
        for name, weights in bound.items():
            try:
                prepared[name] = self.wrappers[name].prepare(weights)
            except ValueError as exc:
                raise LoRAFormatError(f"{path}: layer {name!r}: {exc}") from exc
        refused = self.banks.check_adapter(prepared) if self.banks is not None else None
        if refused:
            raise LoRAFormatError(f"{path}: layer {refused[0]!r}: {refused[1]}")
        nbytes = sum(t.numel() * t.element_size() for w in prepared.values() for t in w.tensors())
        kinds = sorted({m.kind for m in adapter.modules.values()}) if hasattr(adapter, "modules") else []
        return CacheEntry(
            lora_id,
            path,
            prepared,
            name=getattr(request, "lora_name", "") or "",
            meta={"nbytes": nbytes, "kinds": kinds},
        )

    def _free_slot(self, lora_int_id: int) -> None:
        slot = self._slots.release(lora_int_id)
        if slot is not None:
            for name in self._slot_layers[slot]:
                self.wrappers[name].clear_slot(slot)
            self._slot_layers[slot] = ()

    def _ensure_cached(
        self, requests: Sequence[LoRARequest], protected: set[int], *, keep_active: bool = True
    ) -> None:
        """Load the uncached requests as one transaction (victims planned first, committed last).

        ``protected`` ids are never chosen as victims; nor is the current activation unless
        ``keep_active`` is false (a new activation is replacing it).
        """
        missing: dict[int, LoRARequest] = {}
        for request in requests:
            lora_id, path = check_request(request)
            entry = self._cache.get(lora_id)
            if entry is not None:
                if entry.lora_path != path:
                    raise InvalidRequestError(
                        f"LoRA id {lora_id} is cached for {entry.lora_path!r}, not {path!r}; use a distinct lora_int_id"
                    )
                continue
            missing.setdefault(lora_id, request)
        if missing:
            keep = protected | set(missing) | (set(self._active_ids) if keep_active else set())
            replaced: list[int] = []
            try:
                victims = self._cache.plan_eviction(len(missing), keep)
            except LoRACacheError:
                replaced = self._older_pinned_version(missing, keep)
                if not replaced:
                    raise
                victims = replaced
            loaded = [self._load_entry(request) for request in missing.values()]  # off-slot: may fail
            for entry in loaded if replaced else ():
                entry.pinned = True  # the new version takes the pinned place of the old one
            for victim in replaced:
                if self.merged is not None and (self.merged.key or (None,))[0] == victim:
                    self.merged.restore(self.wrappers)
            for evicted in self._cache.commit(victims, loaded):
                self._free_slot(evicted.lora_int_id)
        for request in requests:
            self._cache.touch(request.lora_int_id)

    def _older_pinned_version(self, missing: dict[int, LoRARequest], keep: set[int]) -> list[int]:
        """``[id]`` of the pinned cached entry a single missing adapter replaces in place (another version
        under the same name, in no in-flight request nor the activation), else ``[]``: with every entry
        pinned (``max_cpu_loras=1``, the RL rollout set-up) a new version of a pinned adapter takes its
        place instead of being refused."""
        if len(missing) != 1:
            return []
        name = getattr(next(iter(missing.values())), "lora_name", "") or ""
        olds = [
            i
            for i in self._cache.ids()
            if (e := self._cache.get(i)) is not None
            and name
            and e.name == name
            and e.pinned
            and e.refcount == 0
            and i not in keep
        ]
        return olds[:1]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the host cache.

        A new version (another id, the same ``lora_name``) of a pinned adapter that finds every entry
        pinned or in use takes the old version's place, pinned, once no request holds the old one; the
        new version is read and checked first, so a refused one leaves the old one cached and pinned.

        Returns:
            ``True`` when it was loaded, ``False`` when the id was already cached (it becomes most
            recently used).

        Raises:
            InvalidRequestError: bad id / path, or the id is cached for another path.
            LoRACacheError: the cache is full of pinned / in-use adapters (nothing is read).
            FileNotFoundError, LoRAFormatError: the adapter cannot be read or does not fit the model
                (cache and slots unchanged).
        """
        lora_id, _ = check_request(lora_request)
        with self._lock:
            present = lora_id in self._cache
            self._ensure_cached([lora_request], set())
            return not present

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host cache and its device slot.

        Returns:
            ``False`` when it was not cached.

        Raises:
            LoRACacheError: it is held by an in-flight request or the current activation.
        """
        with self._lock:
            if lora_int_id not in self._cache:
                return False
            if lora_int_id in self._active_ids:
                raise LoRACacheError(
                    f"LoRA {lora_int_id} is part of the current activation; call deactivate() before removing it"
                )
            if self.merged is not None and (self.merged.key or (None,))[0] == lora_int_id:
                self.merged.restore(self.wrappers)
            self._cache.remove(lora_int_id)
            self._free_slot(lora_int_id)
            return True

    def pin_lora(self, lora_int_id: int) -> bool:
        """Never evict this adapter from the host cache (it is preferred for keeping a device slot).

        Raises:
            InvalidRequestError: the adapter is not cached.
        """
        with self._lock:
            entry = self._cache.get(lora_int_id)
            if entry is None:
                raise InvalidRequestError(
                    f"cannot pin LoRA {lora_int_id}: it is not loaded (call add_lora first)"
                )
            entry.pinned = True
            return True

    def unpin_lora(self, lora_int_id: int) -> bool:
        """Make a pinned adapter evictable again; ``False`` when it is not cached."""
        with self._lock:
            entry = self._cache.get(lora_int_id)
            if entry is None:
                return False
            entry.pinned = False
            return True

    def acquire_loras(self, lora_requests: Sequence[LoRARequest]) -> list[int]:
        """Load (if needed) and hold adapters for an in-flight request; pair with :meth:`release_loras`.

        Held adapters are neither evicted nor removable until released. Returns the held ids.
        """
        with self._lock:
            ids = list(dict.fromkeys(check_request(r)[0] for r in lora_requests))
            self._ensure_cached(list(lora_requests), set(ids))
            self._cache.acquire(ids)
            return ids

    def release_loras(self, lora_int_ids: Sequence[int]) -> None:
        """Release adapters held by :meth:`acquire_loras` (one reference per id)."""
        with self._lock:
            self._cache.release(lora_int_ids)

    # ------------------------------------------------------------ activation
    def set_active_adapters(
        self,
        requests_per_sample: Sequence[Sequence[LoRARequest]] | Sequence[LoRARequest],
        scales_per_sample: Sequence[Sequence[float]] | Sequence[float],
    ) -> None:
        """Activate adapters for the next forward passes.

        Args:
            requests_per_sample: one list of ``LoRARequest`` per sample of the forward batch (the
                leading dimension of the denoiser's inputs, including CFG copies), or a flat list of
                ``LoRARequest`` meaning one request that applies to every sample.
            scales_per_sample: the per-adapter scales ``lambda``, same nesting. ``0`` keeps the
                adapter resident (it still counts toward ``max_loras``) but adds exactly nothing. An
                entry may be a :class:`~vllm_omni.lora.schedule.LoRAScaleSchedule` (``steps=None``
                meaning 1.0): per-step scales follow the step the forward context reports
                (:func:`vllm_omni.diffusion.forward_context.denoising_step`).

        Raises:
            InvalidRequestError: (before any work) unequal lengths, more than ``max_loras`` adapters in a
                sample or in the batch, an adapter twice in one sample, a non-finite scale, a bad
                request, or one id with two paths.
            InvalidAdapterError: a schedule's block pattern matches no LoRA layer (nothing changed).
            LoRACacheError, FileNotFoundError, LoRAFormatError: loading failed (nothing changed).
        """
        self._activate(requests_per_sample, scales_per_sample)

    def _activate(self, requests_per_sample, scales_per_sample) -> list[int]:
        broadcast = len(requests_per_sample) > 0 and all(
            isinstance(r, LoRARequest) for r in requests_per_sample
        )
        if broadcast:
            requests_per_sample, scales_per_sample = [list(requests_per_sample)], [list(scales_per_sample)]
        reqs, scales = validate_activation(requests_per_sample, scales_per_sample, self.max_loras)
        if self.banks is not None and not broadcast:
            self.banks.check_rows(len(reqs))
        factors = [
            [self.block_factors(v) if isinstance(v, LoRAScaleSchedule) else None for v in s] for s in scales
        ]
        batch_ids = list(dict.fromkeys(r.lora_int_id for sample in reqs for r in sample))
        with self._lock:
            key = (broadcast, tuple(tuple(r.lora_int_id for r in s) for s in reqs), tuple(map(tuple, scales)))
            if key == self._active_key and all(self._slots.slot_of(i) is not None for i in batch_ids):
                return batch_ids
            first = {}
            for sample in reqs:
                for r in sample:
                    first.setdefault(r.lora_int_id, r)
            try:
                self._ensure_cached(list(first.values()), set(batch_ids), keep_active=False)
                self._fill_slots(batch_ids)
                if not self._merge_if_single(reqs, scales, factors):
                    self._publish_schedule(reqs, scales, factors, broadcast)
            except BaseException:
                # The previous activation may reference slots that were just reused: never leave
                # a half-switched state behind.
                self.deactivate()
                raise
            self._active_ids = tuple(batch_ids)
            self._active_key = key
            return batch_ids

    def _fill_slots(self, batch_ids: list[int]) -> None:
        if all(self._slots.slot_of(i) is not None for i in batch_ids):
            plan = {}  # all resident: nothing to plan (keeps switching O(batch), not O(cache size))
        else:
            pinned = [i for i in self._cache.ids() if self._cache.get(i).pinned]
            plan = self._slots.plan(batch_ids, prefer_keep=pinned)
        for lora_id, (slot, previous) in plan.items():
            payload = self._cache.get(lora_id).payload
            if previous is not None:
                self._slots.release(previous)
            # Only the layers the adapter targets are written and only those the previous occupant
            # touched are cleared: a switch costs O(targeted layers); on a CPU model each write is a
            # reference to the host cache's tensors (see BaseLayerWithLoRA.set_slot).
            wrappers = self.wrappers
            try:
                for name in self._slot_layers[slot]:
                    if name not in payload:
                        wrappers[name].clear_slot(slot)
                self._slot_layers[slot] = ()
                for name, weights in payload.items():
                    wrappers[name].set_slot(slot, weights)
            except Exception:
                for wrapper in wrappers.values():
                    wrapper.clear_slot(slot)
                raise
            self._slot_layers[slot] = tuple(payload)
            self._slots.assign(lora_id, slot)
            self.slot_writes += 1
        for lora_id in batch_ids:
            self._slots.touch(lora_id)

    def block_list_name(self) -> str | None:
        """The primary denoiser's main block list (integer block keys of a schedule index it)."""
        module = next(iter(self.denoisers.values()))
        declared = getattr(module, "lora_block_list", None)
        for name in (declared,) if declared else BLOCK_LIST_NAMES:
            if isinstance(getattr(module, name, None), nn.ModuleList):
                return name
        return None

    def block_factors(self, schedule: LoRAScaleSchedule, where: str = "scale") -> dict[str, float]:
        """Per LoRA layer the block multiplier of ``schedule`` (only those not ``1``), cached.

        Raises:
            InvalidAdapterError: a pattern or block index matches no LoRA layer.
        """
        if not schedule.blocks:
            return {}
        found = self._block_cache.get(schedule.blocks)
        if found is None:
            found = schedule.block_factors(self.wrappers, self.block_list_name(), where)
            if len(self._block_cache) >= 64:
                self._block_cache.clear()
            self._block_cache[schedule.blocks] = found
        return found

    def _publish_schedule(self, reqs: list, scales: list, factors: list, broadcast: bool) -> None:
        """Publish ``scales`` (numbers or schedules); per-step schedules are published at each step."""
        stepped = any(isinstance(v, LoRAScaleSchedule) and v.varies_with_step for s in scales for v in s)

        def at(step: int | None, num_steps: int | None) -> None:
            values = [
                [v.scale_at(step, num_steps) if isinstance(v, LoRAScaleSchedule) else v for v in s]
                for s in scales
            ]
            self._publish(reqs, values, broadcast, factors)

        self._state.set_step_hook(None)
        if stepped:
            self._state.set(0, ())
            self._state.set_step_hook(at)
        else:
            at(None, None)

    def _publish(
        self,
        reqs: list[list[LoRARequest]],
        scales: list[list[float]],
        broadcast: bool,
        factors: list | None = None,
    ) -> None:
        # Plain Python on a [batch, max_loras] table: a switch costs a few microseconds, not a
        # handful of tiny tensor ops per slot; the layers address rows by host-side runs.
        matrix, acts = self._activations(reqs, scales, broadcast)
        overrides: dict[int, tuple[SlotActivation, ...]] = {}
        layers = {name for sample in factors or () for f in sample if f for name in f}
        groups: dict[tuple, tuple[torch.Tensor, tuple[SlotActivation, ...], list[str]]] = {}
        for name in sorted(layers):
            mults = [[f.get(name, 1.0) if f else 1.0 for f in sample] for sample in factors]
            key = tuple(map(tuple, mults))
            if key not in groups:
                scaled = [
                    [v * m for v, m in zip(s, ms, strict=True)] for s, ms in zip(scales, mults, strict=True)
                ]
                groups[key] = (*self._activations(reqs, scaled, broadcast), [])
            groups[key][2].append(name)
            overrides[id(self.wrappers[name])] = groups[key][1]
        self.scale_matrix = matrix
        self._state.set(0 if broadcast else len(reqs), acts, overrides)
        if self.banks is not None:
            self.banks.publish(matrix, [(m, names) for m, _, names in groups.values()])
            self._state.bank_on = self._state.force_bank or bool(acts) or any(g[1] for g in groups.values())

    def _activations(
        self, reqs: list[list[LoRARequest]], scales: list[list[float]], broadcast: bool
    ) -> tuple[torch.Tensor, tuple[SlotActivation, ...]]:
        """The ``[batch, max_loras]`` scale matrix and one :class:`SlotActivation` per used slot."""
        batch = len(reqs)
        table = [[0.0] * self.max_loras for _ in range(batch)]
        for n, (sample, values) in enumerate(zip(reqs, scales, strict=True)):
            for request, value in zip(sample, values, strict=True):
                table[n][self._slots.slot_of(request.lora_int_id)] = value
        matrix = torch.tensor(table, dtype=torch.float32)
        table = matrix.tolist()  # the float32-rounded scales the forward uses
        acts: list[SlotActivation] = []
        for slot in range(self.max_loras):
            full = tuple(row[slot] for row in table)
            values = [v for v in full if v != 0.0]
            if not values:
                continue
            uniform = all(v == values[0] for v in values)
            every_row = broadcast or len(values) == batch
            runs = None if (every_row and uniform) else scale_runs(full)
            acts.append(SlotActivation(slot, values[0] if uniform else None, full, runs))
        return matrix, tuple(acts)

    def _merge_if_single(self, reqs: list, scales: list, factors: list) -> bool:
        """With ``merge``: fold a single adapter into the base weights and publish no slot (``True``);
        otherwise restore any merged weights first (``False``: the caller publishes the slots)."""
        if self.merged is None:
            return False
        single = single_adapter(reqs, scales, factors)
        slot = None if single is None else self._slots.slot_of(single[0])
        if slot is None or not self.merged.mergeable(self.wrappers, slot):
            self.merged.restore(self.wrappers)
            return False
        self.merged.merge(self.wrappers, slot, single)
        self.merged.in_use = True
        self._state.clear()  # no slot applies (compiled regions: the base graph)
        self.scale_matrix = None
        return True

    def _restore_unless_merged_in_use(self, module: nn.Module, args: tuple) -> None:
        """Denoiser forward pre-hook: a forward outside a merged activation runs on the base weights."""
        if self.merged.key is not None and not self.merged.in_use:
            with self._lock:
                self.merged.restore(self.wrappers)

    def deactivate(self) -> None:
        """No adapter applies to the next forward passes (slots stay resident for cheap reuse; merged
        weights stay until a forward or an activation needs others, see :mod:`.merge`)."""
        with self._lock:
            if self.merged is not None:
                self.merged.in_use = False
            self._state.clear()
            self._active_ids = ()
            self._active_key = None
            self.scale_matrix = None

    @contextmanager
    def activate(
        self,
        requests_per_sample: Sequence[Sequence[LoRARequest]] | Sequence[LoRARequest],
        scales_per_sample: Sequence[Sequence[float]] | Sequence[float],
    ) -> Iterator[None]:
        """Activate for the duration of a request (all its denoising steps) and hold its adapters.

        While inside, the adapters cannot be evicted or removed, so every step of the request runs
        with the same weights; on exit they are released and the manager is deactivated.
        """
        with self._lock:
            ids = self._activate(requests_per_sample, scales_per_sample)
            self._cache.acquire(ids)
        try:
            yield
        finally:
            with self._lock:
                self._cache.release(ids)
                self.deactivate()

    @contextmanager
    def activate_adapters(self, adapters: RequestAdapters | Sequence[RequestAdapters]) -> Iterator[None]:
        """:meth:`activate` with the typed value a request's adapters travel in from the entry point.

        Args:
            adapters: one :class:`~vllm_omni.lora.request.RequestAdapters` for every sample of the forward
                batch, or one per sample (its leading dimension, CFG copies included). Each adapter's
                ``scale`` is the one that applies: a number or a schedule (the worker resolved the stage
                defaults; ``None`` is refused like any non-number).

        Raises:
            as :meth:`set_active_adapters`.
        """
        if isinstance(adapters, RequestAdapters):
            reqs, scales = [a.lora for a in adapters], [a.scale for a in adapters]
        else:
            reqs = [[a.lora for a in sample] for sample in adapters]
            scales = [[a.scale for a in sample] for sample in adapters]
        with self.activate(reqs, scales):
            yield

    def sync_step(self) -> None:
        """Bring a per-step schedule's scales to the forward context's step (what a compiled region,
        which cannot run the layers' Python hook, calls before it runs)."""
        self._state.sync_step()

    @property
    def lora_on(self) -> bool:
        """Whether some adapter has a non-zero scale in the current activation (compiled LoRA graph)."""
        return self._state.bank_on

    @property
    def active_lora_ids(self) -> tuple[int, ...]:
        return self._active_ids

    def __repr__(self) -> str:
        return (
            f"DiffusionLoRAManager(layers={len(self.wrappers)}, max_loras={self.max_loras}, "
            f"max_rank={self.max_rank}, max_cpu_loras={self.max_cpu_loras}, cached={self._cache.ids()})"
        )


__all__ = ["DEFAULT_DENOISER_ATTRS", "DiffusionLoRAManager", "LoRACacheError", "find_denoisers"]
