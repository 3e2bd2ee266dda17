"""What stage worker restarts restore and what they lost, per stage and replica.

The adapter registry (:mod:`vllm_omni.lora.registry`) owns the records; this module holds the
restart side of their state: what a restarted worker must hold (:func:`expected_on`), what a
restart could not restore (:class:`RestartLosses`), and the state a record has on a stage after
restarts (:meth:`RestartLosses.state_on`). Ids here are the adapters' public ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from vllm_omni.lora.records import AdapterRecord, StageState
from vllm_omni.lora.request import LoRARequest


def expected_on(records: Iterable[AdapterRecord], stage_id: int) -> list[tuple[LoRARequest, bool]]:
    """``(engine request, pinned)`` of every record in ``records`` that targets ``stage_id`` (what a
    restarted worker of that stage must hold), in the order given."""
    out = []
    for record in records:
        if stage_id in record.targets:
            st = record.stages.get(stage_id, StageState("loaded"))
            out.append((record.engine, st.state == "pinned" or st.pinned))
    return out


def failed_on_stages(records: Iterable[AdapterRecord]) -> dict[int, dict[int, str]]:
    """``{stage_id: {int_id: error}}`` of the records that are ``failed`` on some stage."""
    out: dict[int, dict[int, str]] = {}
    for record in records:
        for stage_id, st in record.stages.items():
            if st.state == "failed":
                out.setdefault(stage_id, {})[record.int_id] = st.error or ""
    return out


class RestartLosses:
    """What the last restart of each stage's worker(s) could not restore:
    ``{stage_id: {replica: {int_id: error}}}``. Not locked: its owner's lock guards it."""

    def __init__(self) -> None:
        self._lost: dict[int, dict[int, dict[int, str]]] = {}

    def note(self, stage_id: int, replica: int, failed: Mapping[int, str]) -> None:
        """Replica ``replica`` of ``stage_id`` restarted and could not restore ``failed``
        (``{int_id: error}``); what its previous restart lost is replaced."""
        self._lost.setdefault(stage_id, {})[replica] = dict(failed)

    def state_on(self, record: AdapterRecord, stage_id: int) -> StageState:
        """``record``'s state on ``stage_id`` given the restarts noted: ``failed`` (one error line per
        replica that lost it, those replicas in ``failed_replicas``), else ``loaded`` / ``pinned``."""
        st = record.stages.get(stage_id, StageState("loaded"))
        pinned = st.state == "pinned" or st.pinned
        lost = [
            (r, m[record.int_id])
            for r, m in sorted(self._lost.get(stage_id, {}).items())
            if record.int_id in m
        ]
        if lost:
            errors = "\n".join(msg for _, msg in lost)
            return StageState("failed", errors, pinned=pinned, failed_replicas=tuple(r for r, _ in lost))
        return StageState("pinned" if pinned else "loaded")

    def forget(self, int_id: int, stages: Sequence[int] | None = None) -> None:
        """``int_id`` was added or removed again on ``stages`` (``None``: every stage): no restart lost
        it there; what restarts of other stages lost stays."""
        for stage_id, per_stage in self._lost.items():
            if stages is None or stage_id in stages:
                for lost in per_stage.values():
                    lost.pop(int_id, None)
