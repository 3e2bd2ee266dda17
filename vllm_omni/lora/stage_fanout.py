"""One adapter version on its target stages, all or nothing: the stage calls of the adapter registry.

:class:`~vllm_omni.lora.registry.AdapterRegistry` decides *what* a stage must hold (versions, targets, pins);
:class:`StageFanOut` makes the stages hold it: every target's check before any load, ``add_lora`` / ``pin_lora``
stage by stage, and on a refusal the stages already done drop what this call loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from vllm_omni.errors import OmniError, restate
from vllm_omni.lora.records import AdapterRecord, StageState
from vllm_omni.lora.request import LoRARequest

logger = logging.getLogger(__name__)

#: ``call(method, *args, stage_id=None) -> {stage_id: result}``: a LoRA method on one stage (or on every
#: stage with LoRA when ``stage_id`` is ``None``); raises ``LoRANotEnabledError`` when no such stage takes
#: adapters (``Orchestrator.lora_call``).
StageCall = Callable[..., dict[int, Any]]


class StageFanOut:
    """The LoRA calls of one engine's stages, as the registry makes them.

    Args:
        call: runs a LoRA method on the stages (:data:`StageCall`).
        check: ``check(stage_id, engine_request)`` raises what a stage would refuse, loading nothing
            (``None``: refusals are only rolled back).
        stage_labels: ``{stage_id: label}`` for messages.
    """

    def __init__(
        self,
        call: StageCall,
        check: Callable[[int, LoRARequest], None] | None = None,
        stage_labels: Mapping[int, str] | None = None,
    ):
        self._call = call
        self._check = check
        self._labels = dict(stage_labels or {})

    def label(self, stage: int) -> str:
        return self._labels.get(stage, f"stage {stage}")

    def load(
        self, record: AdapterRecord, targets: tuple[int, ...], pinned: set[int], repin: bool
    ) -> dict[int, StageState]:
        """``check`` on every target, then ``add_lora`` of ``record.engine`` on each, in order, and ``pin_lora`` on the ``pinned``
        ones (where it was loaded anew, or everywhere with ``repin``); on a refusal the stages already done
        drop what this call loaded, and the error is raised prefixed with the adapter and the stage.
        Returns the stage states."""
        done: list[tuple[int, bool]] = []
        states: dict[int, StageState] = {}
        engine = record.engine
        check = self._check
        for stage in targets:
            if check is None:
                break
            try:
                check(stage, engine)
            except OmniError as exc:
                raise restate(exc, self.where(record, stage)) from exc
        for stage in targets:
            try:
                new = bool(self._call("add_lora", engine, stage_id=stage).get(stage, False))
                done.append((stage, new))
                if stage in pinned and (new or repin):
                    self._call("pin_lora", engine.lora_int_id, stage_id=stage)
                states[stage] = StageState("pinned" if stage in pinned else "loaded")
            except Exception as exc:
                self.roll_back(engine, done)
                if isinstance(exc, OmniError):
                    raise restate(exc, self.where(record, stage)) from exc
                exc.add_note(self.where(record, stage))
                raise
        return states

    def where(self, record: AdapterRecord, stage: int) -> str:
        return f"adapter {record.name!r} ({record.location}) on {self.label(stage)}"

    def roll_back(self, engine: LoRARequest, done: list[tuple[int, bool]]) -> None:
        for stage, new in reversed(done):
            if new:
                try:
                    self._call("remove_lora", engine.lora_int_id, stage_id=stage)
                except Exception:
                    logger.exception("rolling back %s on stage %d failed", engine.lora_name, stage)

    def unload(self, engine: LoRARequest, targets: tuple[int, ...]) -> bool:
        """Best effort: drop an engine id from ``targets`` (every LoRA stage when empty)."""
        removed = False
        for stage in targets or (None,):
            try:
                removed |= any(self._call("remove_lora", engine.lora_int_id, stage_id=stage).values())
            except Exception:
                if targets:
                    logger.exception("dropping %s from stage %s failed", engine.lora_name, stage)
                else:
                    raise
        return removed
