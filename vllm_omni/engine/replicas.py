"""Replicas of a stage: N runtimes of one stage config behind one :class:`StageRuntime`.

Requests go to the least-loaded replica (fewest requests in flight; ties in round-robin
order), so a burst submitted inside ``hold()`` is spread evenly. Adapter management reaches
every replica all-or-nothing: ``add_lora`` / ``remove_lora`` / ``pin_lora`` run on the replicas
in order, and when one fails the replicas already changed are put back before the original
error is raised, its message naming the replica. ``list_loras()`` answers the same whichever
replica a request lands on: the adapters every replica holds.

:func:`start_replicas` builds the replicas through one per-replica constructor,
``make_one(stage, replica_index)`` (an inline runtime, a process worker, a Ray actor), so the
backends differ only in that call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from vllm_omni.config.stage_config import BaseVllmOmniStageConfig
from vllm_omni.engine.protocols import StageDescription, StageRuntime
from vllm_omni.errors import AdapterRestoreError, StageEngineError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest
from vllm_omni.stats import StageStats, merge_replicas

logger = logging.getLogger(__name__)

#: ``make_one(stage, replica_index) -> StageRuntime``: starts one replica.
ReplicaFactory = Callable[[BaseVllmOmniStageConfig, int], StageRuntime]


def start_replicas(stage: BaseVllmOmniStageConfig, make_one: ReplicaFactory) -> StageRuntime:
    """Start ``stage.replicas`` runtimes with ``make_one``; one replica is returned unwrapped.

    Raises:
        whatever ``make_one`` raises; the replicas already started are shut down first.
    """
    if stage.replicas == 1:
        return make_one(stage, 0)
    runtimes: list[StageRuntime] = []
    try:
        for index in range(stage.replicas):
            logger.info("starting %s replica %d of %d", stage.label, index, stage.replicas)
            runtimes.append(make_one(stage, index))
    except BaseException:
        if runtimes:
            ReplicatedStageRuntime(stage, runtimes).shutdown()
        raise
    return ReplicatedStageRuntime(stage, runtimes)


def _name_replica(exc: BaseException, note: str) -> None:
    """Prefix ``note`` to ``exc``'s message (same object, same type, so callers still classify it)."""
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{note}: {exc.args[0]}",)
    else:
        exc.add_note(note)


class ReplicatedStageRuntime:
    """One stage served by several runtimes of the same config (the ``StageRuntime`` protocol).

    Args:
        stage: the stage config every replica runs.
        runtimes: the started replicas, in replica order (at least one).

    Every method is thread-safe. Adapter calls are serialised, so two management calls never
    interleave across the replicas.
    """

    def __init__(self, stage: BaseVllmOmniStageConfig, runtimes: Sequence[StageRuntime]):
        if not runtimes:
            raise ValueError(f"{stage.label}: a replicated stage needs at least one runtime")
        self.stage = stage
        self.runtimes = list(runtimes)
        self._lock = threading.Lock()
        self._in_flight = [0] * len(self.runtimes)
        self._next = 0  # where the round-robin among equally loaded replicas starts
        self._lora_lock = threading.RLock()
        self._requests: dict[int, LoRARequest] = {}  # adapters added through this runtime
        self._pinned: set[int] = set()
        self._closed = False

    # ---------------------------------------------------------------- requests
    def in_flight(self) -> list[int]:
        """Requests submitted and not yet done, per replica."""
        with self._lock:
            return list(self._in_flight)

    def _pick(self, exclude: Sequence[int] = ()) -> int:
        """The least-loaded replica not in ``exclude`` (ties: the next in round-robin order); counted."""
        with self._lock:
            n = len(self.runtimes)
            order = [(self._next + k) % n for k in range(n) if (self._next + k) % n not in exclude]
            index = min(order, key=lambda i: self._in_flight[i])
            self._in_flight[index] += 1
            self._next = (index + 1) % n
            return index

    def _finished(self, index: int) -> None:
        with self._lock:
            self._in_flight[index] -= 1

    def _on_done(self, index: int, _future: Future) -> None:
        self._finished(index)

    def submit(self, request: StageRequest) -> Future:
        """Queue one request on the least-loaded replica (see :meth:`StageRuntime.submit`).

        A replica that refuses with ``StageEngineError`` (shut down, dead) or
        ``AdapterRestoreError`` (its last restart lost the adapter) is skipped for the next one;
        other user errors are raised at once.

        Raises (synchronously): the replica's ``OmniUserError``; ``StageEngineError`` when this
        stage is shut down or no replica accepts the request (the last replica's error).
        """
        if self._closed:
            raise StageEngineError(f"{self.stage.label} is shut down")
        tried: list[int] = []
        while True:
            index = self._pick(tried)
            try:
                future = self.runtimes[index].submit(request)
            except (StageEngineError, AdapterRestoreError) as exc:
                self._finished(index)
                tried.append(index)
                if len(tried) == len(self.runtimes):
                    raise
                logger.warning(
                    "%s replica %d refused a request (%s); trying another", self.stage.label, index, exc
                )
                continue
            except BaseException:
                self._finished(index)
                raise
            future.add_done_callback(functools.partial(self._on_done, index))
            return future

    def validate_request(self, request: StageRequest) -> None:
        """Every check of :meth:`submit` (the replicas share one config: replica 0 checks)."""
        self.runtimes[0].validate_request(request)

    def prepare_params(self, params: Any) -> Any:
        """``params`` made ready once (the replicas share one config: replica 0 prepares)."""
        return self.runtimes[0].prepare_params(params)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Requests submitted inside the block start together on every replica when it exits."""
        with contextlib.ExitStack() as stack:
            for runtime in self.runtimes:
                stack.enter_context(runtime.hold())
            yield

    # ---------------------------------------------------------------- adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every replica; ``True`` if some replica loaded it anew.

        Raises:
            the first failing replica's error (message prefixed with the replica), after the
            replicas that loaded it anew dropped it again.
        """
        lora_id = lora_request.lora_int_id
        with self._lora_lock:
            results = self._on_all(
                "add_lora", (lora_request,), lambda i, new: new and self.runtimes[i].remove_lora(lora_id)
            )
            self._requests[lora_id] = lora_request
            return any(results)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from every replica; ``True`` if some replica held it.

        Raises:
            the first failing replica's error (prefixed with the replica), after the replicas
            that dropped it loaded (and pinned) it again: possible for adapters added through
            this runtime; the message says which replicas could not be restored.
        """
        with self._lora_lock:

            def restore_if_removed(i: int, had: Any) -> None:
                if had:
                    self._restore(i, lora_int_id)

            results = self._on_all("remove_lora", (lora_int_id,), restore_if_removed)
            self._requests.pop(lora_int_id, None)
            self._pinned.discard(lora_int_id)
            return any(results)

    def pin_lora(self, lora_int_id: int) -> bool:
        """Pin a loaded adapter on every replica.

        Raises:
            the first failing replica's error (prefixed with the replica), after the replicas
            already pinned were unpinned (the adapter is dropped and loaded again unpinned).
        """
        with self._lora_lock:
            was_pinned = lora_int_id in self._pinned

            def undo(index: int, _: Any) -> None:
                if not was_pinned:
                    self.runtimes[index].remove_lora(lora_int_id)
                    self._restore(index, lora_int_id, pin=False)

            results = self._on_all("pin_lora", (lora_int_id,), undo)
            self._pinned.add(lora_int_id)
            return all(results)

    def list_loras(self) -> set[int]:
        """Ids of the adapters every replica holds (what any request can use without loading).

        An adapter a request loaded on its own replica only is not listed; an unpinned adapter
        evicted on one replica is not listed either (as a single runtime would not list it).

        Raises:
            StageEngineError: the replicas disagree about an adapter pinned through this runtime
                (pinned adapters are never evicted, so one missing means a replica lost it);
                the message gives each replica's set.
        """
        with self._lora_lock:
            sets = [set(runtime.list_loras()) for runtime in self.runtimes]
            missing = {i: sorted(self._pinned - s) for i, s in enumerate(sets) if self._pinned - s}
        if missing:
            raise StageEngineError(
                f"{self.stage.label}: replicas disagree about loaded adapters: pinned adapter(s) missing on "
                + ", ".join(f"replica {i}: {ids}" for i, ids in missing.items())
                + f"; adapters per replica: {[sorted(s) for s in sets]}"
            )
        return set.intersection(*sets)

    def _on_all(self, method: str, args: tuple, undo: Callable[[int, Any], Any]) -> list[Any]:
        """``method(*args)`` on every replica in order; on a failure ``undo(index, result)`` runs
        on the replicas done so far (latest first) and the original error is raised, renamed."""
        done: list[tuple[int, Any]] = []
        for index, runtime in enumerate(self.runtimes):
            try:
                done.append((index, getattr(runtime, method)(*args)))
            except Exception as exc:
                not_undone = []
                for i, result in reversed(done):
                    try:
                        undo(i, result)
                    except Exception:
                        logger.exception("%s replica %d: rolling back %s failed", self.stage.label, i, method)
                        not_undone.append(i)
                state = (
                    f"rolled back on replica(s) {[i for i, _ in done]}" if done else "no replica was changed"
                )
                if not_undone:
                    state += f"; the rollback FAILED on replica(s) {sorted(not_undone)}"
                _name_replica(
                    exc,
                    f"{self.stage.label} replica {index} of {len(self.runtimes)}: {method} failed ({state})",
                )
                raise
        return [result for _, result in done]

    def _restore(self, index: int, lora_int_id: int, pin: bool | None = None) -> None:
        """Load (and, if it was pinned, pin) an adapter added through this runtime on one replica."""
        request = self._requests.get(lora_int_id)
        if request is None:
            raise StageEngineError(
                f"{self.stage.label} replica {index}: adapter {lora_int_id} was not added through "
                f"add_lora (a start-up adapter?); it cannot be loaded again here"
            )
        self.runtimes[index].add_lora(request)
        if pin is None:
            pin = lora_int_id in self._pinned
        if pin:
            self.runtimes[index].pin_lora(lora_int_id)

    def describe(self) -> StageDescription:
        """The first replica's description (every replica runs the same stage config)."""
        return self.runtimes[0].describe()

    def attach_adapter_owner(self, expected: Any, on_restart: Any) -> None:
        """Attach the owner of the stage's adapters to every replica that restarts (see
        :meth:`SupervisedStageRuntime.attach_adapter_owner
        <vllm_omni.engine.workers.supervisor.SupervisedStageRuntime.attach_adapter_owner>`); what a
        replica could not restore is reported with its index, its messages prefixed ``replica <i>:``."""
        for index, runtime in enumerate(self.runtimes):
            attach = getattr(runtime, "attach_adapter_owner", None)  # inline replicas never restart
            if attach is not None:

                def report(failed: dict[int, str], _replica: int, index: int = index) -> None:
                    on_restart({i: f"replica {index}: {msg}" for i, msg in failed.items()}, index)

                attach(expected, report)

    def failed_loras(self) -> dict[int, str]:
        """``{lora_int_id: error}`` of adapters a replica's last restart could not restore
        (the message names the replica; that replica refuses requests naming them)."""
        out: dict[int, str] = {}
        for index, runtime in enumerate(self.runtimes):
            for lora_int_id, error in getattr(runtime, "failed_loras", dict)().items():
                out.setdefault(lora_int_id, f"replica {index}: {error}")
        return out

    def stats(self) -> StageStats:
        """The replicas' statistics summed (:func:`~vllm_omni.stats.merge_replicas`); a replica that
        cannot answer (restarting) is left out, and with none the error of the first is raised."""
        snaps, indexes, errors = [], [], []
        for index, runtime in enumerate(self.runtimes):
            try:
                snaps.append(runtime.stats())
                indexes.append(index)
            except Exception as exc:
                errors.append(exc)
        if not snaps:
            raise errors[0]
        return merge_replicas(snaps, indexes)

    # ---------------------------------------------------------------- shutdown
    def health(self) -> str:
        """``"ready"`` while at least one replica is ready (requests go to the ready ones),
        else ``"restarting"`` if one is being replaced, ``"starting"`` if one is starting, else ``"dead"``."""
        states = [runtime.health() for runtime in self.runtimes]
        for state in ("ready", "restarting", "starting"):
            if state in states:
                return state
        return "dead"

    def shutdown(self, timeout: float | None = None) -> None:
        """Shut every replica down at once (each within ``timeout``; the whole call too). Idempotent."""
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout

        def stop(runtime: StageRuntime) -> None:
            try:
                runtime.shutdown(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except Exception:  # best effort: the other replicas still stop
                logger.exception("%s: error while shutting down a replica", self.stage.label)

        threads = [
            threading.Thread(target=stop, args=(r,), name=f"omni-stop-{self.stage.stage_id}-{i}", daemon=True)
            for i, r in enumerate(self.runtimes)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            logger.warning("%s: some replicas were still stopping after %s s", self.stage.label, timeout)
