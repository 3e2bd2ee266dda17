"""Bookkeeping for the host adapter cache and the device slots (no tensors are moved here).

:class:`AdapterCache` is a least-recently-used cache of loaded adapters with pins (never evicted)
and reference counts (adapters held by in-flight requests are never evicted and cannot be removed).
Insertion is two-phase so a failed load changes nothing: :meth:`AdapterCache.plan_eviction` picks
the victims (or fails) before any file is read, and :meth:`AdapterCache.commit` evicts them and
inserts the new entries only once they are fully loaded. The cache never holds more than
``capacity`` entries.

:class:`SlotTable` maps adapter ids to device slots, least-recently-used first for reuse.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.errors import ConfigError, LoRACacheError


@dataclass
class CacheEntry:
    """One cached adapter.

    Attributes:
        lora_int_id: adapter id.
        lora_path: where it was loaded from (an id must keep its path).
        payload: the bound host weights (opaque to the cache).
        pinned: never evicted.
        refcount: in-flight requests holding it.
    """

    lora_int_id: int
    lora_path: str
    payload: Any
    pinned: bool = False
    refcount: int = 0
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


class AdapterCache:
    """LRU cache of adapters keyed by ``lora_int_id`` (see module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"cache capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def ids(self) -> list[int]:
        """Cached ids, least recently used first."""
        return list(self._entries)

    def get(self, lora_int_id: int) -> CacheEntry | None:
        return self._entries.get(lora_int_id)

    def touch(self, lora_int_id: int) -> None:
        """Mark as most recently used."""
        self._entries.move_to_end(lora_int_id)

    def evictable(self, entry: CacheEntry) -> bool:
        return not entry.pinned and entry.refcount == 0

    def plan_eviction(self, n_new: int, protected: Iterable[int] = ()) -> list[int]:
        """Ids to evict so that ``n_new`` more entries fit, least recently used first.

        Raises:
            LoRACacheError: not enough entries are evictable (pinned, in use, or ``protected``).
        """
        needed = len(self._entries) + n_new - self.capacity
        if needed <= 0:
            return []
        keep = set(protected)
        victims = [i for i, e in self._entries.items() if self.evictable(e) and i not in keep][:needed]
        if len(victims) < needed:
            pinned = [e.name or i for i, e in self._entries.items() if e.pinned]
            busy = [e.name or i for i, e in self._entries.items() if e.refcount > 0]
            kept = [self._entries[i].name or i for i in sorted(keep) if i in self._entries]
            raise LoRACacheError(
                f"LoRA cache is full ({len(self._entries)}/{self.capacity}) and cannot make room for {n_new} "
                f"adapter(s): pinned={pinned}, in use={busy}, needed alongside={kept}; "
                "remove an adapter, wait for the requests using one, or raise max_cpu_loras"
            )
        return victims

    def commit(self, victims: Iterable[int], new_entries: Iterable[CacheEntry]) -> list[CacheEntry]:
        """Evict ``victims`` then insert ``new_entries`` (most recently used last). Returns the evicted entries."""
        evicted = [self._entries.pop(v) for v in victims]
        for entry in new_entries:
            self._entries[entry.lora_int_id] = entry
        if len(self._entries) > self.capacity:  # guarded by plan_eviction; keep the invariant loud
            raise AssertionError("LoRA cache exceeded its capacity")
        return evicted

    def remove(self, lora_int_id: int) -> CacheEntry:
        """Drop an entry.

        Raises:
            KeyError: not cached.
            LoRACacheError: in use by an in-flight request.
        """
        entry = self._entries[lora_int_id]
        if entry.refcount > 0:
            raise LoRACacheError(
                f"LoRA {lora_int_id} is in use by {entry.refcount} in-flight request(s); remove it after they finish"
            )
        return self._entries.pop(lora_int_id)

    def acquire(self, ids: Iterable[int]) -> None:
        for i in ids:
            self._entries[i].refcount += 1

    def release(self, ids: Iterable[int]) -> None:
        for i in ids:
            entry = self._entries.get(i)
            if entry is not None and entry.refcount > 0:
                entry.refcount -= 1


class SlotTable:
    """Assignment of adapter ids to ``num_slots`` device slots, with LRU reuse."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = int(num_slots)
        self._slot_of: OrderedDict[int, int] = OrderedDict()

    def slot_of(self, lora_int_id: int) -> int | None:
        return self._slot_of.get(lora_int_id)

    def mapping(self) -> dict[int, int]:
        """id -> slot, least recently used first."""
        return dict(self._slot_of)

    def touch(self, lora_int_id: int) -> None:
        self._slot_of.move_to_end(lora_int_id)

    def plan(
        self, needed: Iterable[int], prefer_keep: Iterable[int] = ()
    ) -> dict[int, tuple[int, int | None]]:
        """Slots for the ids in ``needed`` that hold no slot yet.

        Returns:
            id -> (slot, id currently in that slot or ``None``). Free slots are used first, then the
            least recently used slots not in ``needed``; ids in ``prefer_keep`` (pinned) go last.

        Raises:
            LoRACacheError: more distinct ids than slots.
        """
        needed = list(dict.fromkeys(needed))
        if len(needed) > self.num_slots:
            raise LoRACacheError(f"{len(needed)} adapters requested but only {self.num_slots} device slots")
        used = set(self._slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        keep = set(prefer_keep)
        reusable = [i for i in self._slot_of if i not in needed and i not in keep]
        reusable += [i for i in self._slot_of if i not in needed and i in keep]
        plan: dict[int, tuple[int, int | None]] = {}
        for lora_id in needed:
            if lora_id in self._slot_of:
                continue
            if free:
                plan[lora_id] = (free.pop(0), None)
            else:
                victim = reusable.pop(0)
                plan[lora_id] = (self._slot_of[victim], victim)
        return plan

    def assign(self, lora_int_id: int, slot: int) -> None:
        for other, s in list(self._slot_of.items()):
            if s == slot:
                del self._slot_of[other]
        self._slot_of[lora_int_id] = slot

    def release(self, lora_int_id: int) -> int | None:
        """Forget ``lora_int_id``'s slot; returns the freed slot."""
        return self._slot_of.pop(lora_int_id, None)
