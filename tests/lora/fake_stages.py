"""Stand-in stages for the adapter registry's own tests: the LoRA calls of ``Orchestrator.lora_call``
over in-memory caches, so registry rules (versions, all-or-nothing, concurrency) are checked in
milliseconds. The stage side of every rule is checked again on real engines elsewhere."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_omni.errors import ConfigError, InvalidAdapterError, LoRANotEnabledError


class FakeStages:
    """``n`` stages; ``lora_stages`` take adapters. ``refuse(stage_id, lora) -> str | None`` makes a stage
    refuse an ``add_lora`` with that message; ``delay`` (s) widens race windows inside ``add_lora`` and ``remove_lora``."""

    def __init__(
        self,
        n: int = 1,
        lora_stages: tuple[int, ...] | None = None,
        refuse: Callable[[int, Any], str | None] | None = None,
        delay: float = 0.0,
    ):
        self.n = n
        self.lora_stages = tuple(range(n)) if lora_stages is None else lora_stages
        self.loaded: dict[int, dict[int, Any]] = {s: {} for s in range(n)}  # stage -> engine id -> request
        self.pinned: dict[int, set[int]] = {s: set() for s in range(n)}
        self.refuse = refuse
        self.delay = delay
        self.calls: list[tuple[str, int, Any]] = []
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any, stage_id: int | None = None) -> dict[int, Any]:
        if stage_id is not None and not 0 <= stage_id < self.n:
            raise ConfigError(f"no stage {stage_id}")
        stages = [stage_id] if stage_id is not None else list(range(self.n))
        out = {}
        for s in stages:
            if s not in self.lora_stages:
                if stage_id is not None:
                    raise LoRANotEnabledError(f"Stage {s} does not have LoRA enabled")
                continue
            out[s] = getattr(self, "_" + method)(s, *args)
        if not out:
            raise LoRANotEnabledError(f"{method}: no stage has LoRA enabled")
        return out

    def _add_lora(self, stage: int, lora: Any) -> bool:
        why = self.refuse(stage, lora) if self.refuse else None
        if self.delay:
            time.sleep(self.delay)
        if why:
            raise InvalidAdapterError(why)
        with self._lock:
            self.calls.append(("add_lora", stage, lora))
            held = self.loaded[stage].get(lora.lora_int_id)
            if held is not None and held.lora_path != lora.lora_path:
                raise InvalidAdapterError(f"id {lora.lora_int_id} cached for another path")
            self.loaded[stage][lora.lora_int_id] = lora
            return held is None

    def _remove_lora(self, stage: int, lora_id: int) -> bool:
        if self.delay:
            time.sleep(self.delay)
        with self._lock:
            self.calls.append(("remove_lora", stage, lora_id))
            self.pinned[stage].discard(lora_id)
            return self.loaded[stage].pop(lora_id, None) is not None

    def _pin_lora(self, stage: int, lora_id: int) -> bool:
        with self._lock:
            if lora_id not in self.loaded[stage]:
                raise ValueError(f"cannot pin LoRA {lora_id}: not loaded")
            self.pinned[stage].add(lora_id)
            return True

    def _list_loras(self, stage: int) -> set[int]:
        with self._lock:
            return set(self.loaded[stage])
