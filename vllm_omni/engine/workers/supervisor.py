"""One supervised worker runtime, whatever carries its messages (``mp`` pipe, Ray actor).

:class:`SupervisedStageRuntime` is the part of a stage's
:class:`~vllm_omni.engine.protocols.StageRuntime` that does not depend on the transport; the
transports (:class:`~vllm_omni.engine.workers.client.WorkerStageRuntime` over a pipe to a
spawned process, :class:`~vllm_omni.engine.workers.ray_backend.RayStageRuntime` over a Ray
actor) subclass it and only start, stop and talk to one worker. What lives here, once:

Health. :data:`HEALTH_STATES`: ``"starting"`` (first worker not up yet), ``"ready"``,
``"restarting"`` (its worker died; a new one is being started) and ``"dead"`` (restarts
exhausted, or shut down).

Restart policy (:class:`RestartPolicy`, from the stage options ``max_restarts`` and
``restart_backoff_s``; :mod:`vllm_omni.config.supervision`). ``max_restarts`` is the number of restart **attempts** the runtime may
make over its whole life: every start of a replacement worker counts, whether it comes up or
not. Before an attempt the supervisor waits ``restart_backoff_s`` x 2^(attempts that failed in a
row), at most :data:`BACKOFF_MAX_S`. When a worker dies and no attempt is left (or the last one
failed), the stage is ``"dead"``; its error names the stage, the attempt and the cause.

In-flight requests. When a worker dies, every request and call in flight on it fails with
:class:`~vllm_omni.errors.StageDeadError` naming the stage and the death; while the stage is
not ``"ready"``, new calls raise it at once. Other stages keep serving.

LoRA. Successful ``add_lora`` / ``remove_lora`` / ``pin_lora`` calls are journaled
(:class:`~vllm_omni.engine.workers.lora_journal.LoRAJournal`) and replayed into each new
worker. A restart restores what it can: an adapter that cannot be loaded again (its files
deleted or unreadable) does not fail the restart; it is listed by :meth:`failed_loras` with
an :class:`~vllm_omni.errors.AdapterRestoreError` naming the stage, the adapter and its path,
and requests naming it are refused with that error (HTTP 400) until it is added again (or a
later restart restores it).

Processes. Every worker the supervisor started is stopped (shutdown message, then killed)
when it is replaced and on :meth:`shutdown`, so no worker outlives the stage and no pipe read
waits forever.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.config.supervision import BACKOFF_MAX_S, DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_BACKOFF_S
from vllm_omni.engine.workers.lora_journal import LoRAJournal, replay_adapters
from vllm_omni.errors import AdapterRestoreError, StageDeadError, StageEngineError

logger = logging.getLogger(__name__)

#: The health vocabulary of every stage runtime (``StageRuntime.health``).
HEALTH_STATES = ("starting", "ready", "restarting", "dead")


@dataclass(frozen=True)
class RestartPolicy:
    """How a stage's worker is restarted (see the module docstring).

    Attributes:
        max_restarts: restart attempts allowed over the runtime's life (``0``: never restart).
        backoff_s: seconds before an attempt after a death; doubled per attempt that failed in
            a row, at most :data:`BACKOFF_MAX_S`.
    """

    max_restarts: int = DEFAULT_MAX_RESTARTS
    backoff_s: float = DEFAULT_RESTART_BACKOFF_S

    @classmethod
    def of(cls, stage: Any) -> RestartPolicy:
        """The policy of a stage config (its ``max_restarts`` / ``restart_backoff_s``; defaults when unset)."""
        return cls(
            getattr(stage, "max_restarts", DEFAULT_MAX_RESTARTS),
            getattr(stage, "restart_backoff_s", DEFAULT_RESTART_BACKOFF_S),
        )

    def delay(self, failed_in_a_row: int) -> float:
        """Seconds to wait before the next attempt."""
        return min(self.backoff_s * 2**failed_in_a_row, BACKOFF_MAX_S)


@dataclass
class Pending:
    """One request or call in flight on a worker: its result ``future`` and, for a request, the
    ``ack`` of ``submit``'s synchronous checks; ``on_partial``: the streaming consumer."""

    on_partial: Any = None
    future: Future = field(default_factory=Future)
    ack: Future | None = None
    handle: Any = None  # the worker it runs on

    def fail(self, err: BaseException) -> None:
        for fut in (self.ack, self.future):
            if fut is not None:
                with contextlib.suppress(InvalidStateError):
                    fut.set_exception(err)


class SupervisedStageRuntime:
    """Health, restarts, journal replay and in-flight bookkeeping of a stage whose runtime runs in a worker.

    Subclasses implement the transport: :meth:`_start_worker` (start one worker, wait until
    its runtime runs, return a handle; raise the start-up error), :meth:`_stop_worker` (stop it
    and reap whatever it started, bounded by ``timeout``), :meth:`_worker_call` (run a runtime
    method in that worker, raising its errors with their class) and :meth:`_describe` (e.g.
    ``"pid 123"``). They call :meth:`_worker_died` when they learn that a worker is gone.

    Args:
        stage: the resolved stage config (``label``, ``max_restarts``, ``restart_backoff_s``).

    Attributes:
        journal: the adapters added and pinned at run time, while no owner is attached
            (:meth:`attach_adapter_owner`).
        restarts: workers started after a death so far (successful restarts).
        restart_attempts: restart attempts so far (what ``max_restarts`` bounds).
    """

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.policy = RestartPolicy.of(stage)
        self.journal = LoRAJournal()
        self.restarts = 0
        self.restart_attempts = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._state = "starting"
        self._handle: Any = None
        self._started: list[Any] = []  # every worker started and not yet stopped
        self._in_flight: dict[Any, Pending] = {}
        self._failed: dict[int, AdapterRestoreError] = {}
        self._last_death = ""
        self._dead_error: StageDeadError | None = None
        self._description: Any = None
        self._owner: (
            tuple[Callable[[], list[tuple[Any, bool]]], Callable[[dict[int, str], int], None]] | None
        ) = None

    def attach_adapter_owner(
        self,
        expected: Callable[[], list[tuple[Any, bool]]],
        on_restart: Callable[[dict[int, str], int], None],
    ) -> None:
        """Let the owner of the stage's adapters (the engine's adapter registry) say what a restarted
        worker must hold, instead of this runtime's journal of its LoRA calls.

        Args:
            expected: ``() -> [(LoRARequest, pinned)]``, in the order they were registered.
            on_restart: ``(failed, replica)`` after each restart: ``{lora_int_id: message}`` of the
                adapters it could not restore (``{}``: all were), and ``0`` (a replicated stage passes
                the replica's index).
        """
        self._owner = (expected, on_restart)

    def _expected_adapters(self) -> tuple[list[Any], list[int]]:
        """``(adapters to add, ids to pin)`` in a restarted worker."""
        if self._owner is None:
            return self.journal.entries()
        expected = self._owner[0]()
        return [r for r, _ in expected], [r.lora_int_id for r, pinned in expected if pinned]

    # ---------------------------------------------------------------- transport hooks
    def _start_worker(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _stop_worker(self, handle: Any, timeout: float | None) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _worker_call(self, handle: Any, method: str, *args: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _describe(self, handle: Any) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---------------------------------------------------------------- life
    def _begin(self) -> None:
        """Start the first worker (its start-up error is raised; nothing is left running)."""
        try:
            handle = self._launch()
        except BaseException:
            self._closed.set()
            with self._lock:
                self._state = "dead"
            raise
        with self._lock:
            self._handle = handle
            self._state = "ready"

    def _launch(self) -> Any:
        """One worker started and registered for reaping (stopped again if shut down meanwhile)."""
        handle = self._start_worker()
        with self._lock:
            self._started.append(handle)
            closed = self._closed.is_set()
        if closed:
            self._stop(handle, 5.0)
            raise StageEngineError(f"{self.stage.label}: shut down while its worker was starting")
        return handle

    def _stop(self, handle: Any, timeout: float | None) -> None:
        with self._lock:
            if handle not in self._started:
                return
            self._started.remove(handle)
        try:
            self._stop_worker(handle, timeout)
        except Exception:
            logger.exception("%s: stopping worker %s failed", self.stage.label, self._describe(handle))

    def health(self) -> str:
        """One of :data:`HEALTH_STATES`."""
        return "dead" if self._closed.is_set() else self._state

    def _worker_died(self, handle: Any, cause: str) -> None:
        """A transport learned that ``handle``'s worker is gone (``cause``: how, e.g. the exit
        code): fail what was in flight and start restarting (once per worker)."""
        death = f"{self._describe(handle)}, {cause}"
        with self._lock:
            current = handle is self._handle and not self._closed.is_set() and self._state == "ready"
            if current:
                self._state = "restarting"
                self._last_death = death
        err = StageDeadError(f"{self.stage.label}: its worker died ({death}); its in-flight requests failed")
        self._fail_in_flight(err, handle)
        if not current:
            return
        logger.error("%s", err)
        threading.Thread(
            target=self._restart_loop,
            args=(handle,),
            name=f"omni-stage-{self.stage.stage_id}-restart",
            daemon=True,
        ).start()

    def _restart_loop(self, dead: Any) -> None:
        """Replace the dead worker under :attr:`policy`; ``"dead"`` when no attempt is left."""
        label = self.stage.label
        self._stop(dead, 5.0)
        failed_in_a_row = 0
        cause = (
            f"its {self.policy.max_restarts} restart attempt(s) (max_restarts) are used up"
            if self.policy.max_restarts
            else "restarts are disabled (max_restarts 0)"
        )
        while self.restart_attempts < self.policy.max_restarts:
            if self._closed.wait(self.policy.delay(failed_in_a_row)):
                return
            self.restart_attempts += 1
            attempt = f"restart attempt {self.restart_attempts} of {self.policy.max_restarts}"
            try:
                handle = self._launch()
            except Exception as exc:
                cause = f"{attempt} failed: {type(exc).__name__}: {exc}"
                logger.error("%s: %s", label, cause)
                failed_in_a_row += 1
                continue
            added, pinned = self._expected_adapters()
            try:
                failed = replay_adapters(
                    added, pinned, lambda method, *args, _h=handle: self._worker_call(_h, method, *args)
                )
            except Exception as exc:  # the new worker died while adapters were replayed
                self._stop(handle, 5.0)
                cause = f"{attempt} failed while restoring adapters: {type(exc).__name__}: {exc}"
                logger.error("%s: %s", label, cause)
                failed_in_a_row += 1
                continue
            if self._install(handle, failed, {r.lora_int_id: r for r in added}):
                logger.warning("%s: worker restarted (%s, %s)", label, self._describe(handle), attempt)
            return
        with self._lock:
            self._state = "dead"
            self._dead_error = StageDeadError(
                f"{label} is dead: its worker died ({self._last_death}) and could not be restarted: {cause}"
            )
        logger.error("%s", self._dead_error)

    def _install(self, handle: Any, failed: dict[int, BaseException], requests: dict[int, Any]) -> bool:
        """Make ``handle`` the serving worker with ``failed`` adapters marked and reported to the owner
        (``False``: shut down meanwhile)."""
        marks = {i: self._restore_error(i, requests.get(i), exc) for i, exc in failed.items()}
        with self._lock:
            installed = not self._closed.is_set()
            if installed:
                self._handle = handle
                self._failed = marks
                self._state = "ready"
                self.restarts += 1
        if not installed:
            self._stop(handle, 5.0)
            return False
        if self._owner is not None:
            self._owner[1]({i: str(err) for i, err in marks.items()}, 0)
        return True

    def _restore_error(self, lora_int_id: int, request: Any, exc: BaseException) -> AdapterRestoreError:
        name, path = (request.lora_name, request.lora_path) if request is not None else ("?", "?")
        err = AdapterRestoreError(
            f"{self.stage.label}: adapter {name!r} (id {lora_int_id}) could not be restored after its worker "
            f"restarted: loading {path} failed: {type(exc).__name__}: {exc}; requests naming it are refused "
            f"until it is added again (remove_lora, then add_lora) or a later restart restores it"
        )
        logger.error("%s", err)
        return err

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every worker this runtime started (gracefully within ``timeout`` seconds, then
        killed); what is in flight fails with ``StageEngineError``. Idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            handles = list(self._started)
            serving = self._handle if self._state == "ready" else None
        for handle in handles:
            self._stop(handle, timeout if handle is serving else 5.0)
        self._fail_in_flight(StageEngineError(f"{self.stage.label}: shut down"))
        self._after_shutdown()

    def _after_shutdown(self) -> None:
        """Transport clean-up after every worker stopped (threads, cluster connections)."""

    # ---------------------------------------------------------------- calls
    def _serving(self) -> Any:
        """The serving worker's handle.

        Raises:
            StageEngineError: shut down; StageDeadError: the stage is restarting or dead.
        """
        with self._lock:
            if self._closed.is_set():
                raise StageEngineError(f"{self.stage.label} is shut down")
            if self._state == "dead" and self._dead_error is not None:
                raise StageDeadError(str(self._dead_error))
            if self._state != "ready":
                raise StageDeadError(
                    f"{self.stage.label} is {self._state}: its worker process died ({self._last_death})"
                )
            return self._handle

    def _track(self, key: Any, pending: Pending) -> None:
        with self._lock:
            self._in_flight[key] = pending

    def _untrack(self, key: Any) -> Pending | None:
        with self._lock:
            return self._in_flight.pop(key, None)

    def _fail_in_flight(self, err: BaseException, handle: Any = None) -> None:
        """Fail what is in flight (on ``handle``'s worker only, when given)."""
        with self._lock:
            keys = [k for k, p in self._in_flight.items() if handle is None or p.handle is handle]
            pending = [self._in_flight.pop(k) for k in keys]
        for entry in pending:
            entry.fail(err)

    def _call(self, method: str, *args: Any) -> Any:
        return self._worker_call(self._serving(), method, *args)

    # ---------------------------------------------------------------- LoRA
    def check_adapters(self, request: Any) -> None:
        """Refuse a request (a :class:`~vllm_omni.inputs.stage_request.StageRequest`) naming an
        adapter the last restart could not restore.

        Raises:
            AdapterRestoreError: naming the stage, the adapter and its path.
        """
        if not self._failed:
            return
        for lora_int_id in request.adapters.ids:
            err = self._failed.get(lora_int_id)
            if err is not None:
                raise AdapterRestoreError(str(err))

    def failed_loras(self) -> dict[int, str]:
        """``{lora_int_id: error message}`` of the adapters the last restart could not restore."""
        return {i: str(err) for i, err in self._failed.items()}

    def _journaled(self, method: str, *args: Any) -> Any:
        result = self._call(method, *args)
        if self._owner is None and (method != "pin_lora" or result):
            self.journal.record(method, args)
        if method in ("add_lora", "remove_lora"):
            lora_int_id = args[0].lora_int_id if method == "add_lora" else args[0]
            with self._lock:
                self._failed.pop(lora_int_id, None)
        return result

    def add_lora(self, lora_request: Any) -> bool:
        """As the worker's runtime (its errors raised here); remembered for a restart."""
        return self._journaled("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._journaled("remove_lora", lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        return self._journaled("pin_lora", lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self._call("list_loras"))

    def stats(self) -> Any:
        """The worker runtime's statistics snapshot (:class:`~vllm_omni.stats.StageStats`)."""
        return self._call("stats")

    def describe(self) -> Any:
        """The worker runtime's :class:`~vllm_omni.engine.protocols.StageDescription`, asked once and
        kept (a restarted worker runs the same stage config)."""
        if self._description is None:
            self._description = self._call("describe")
        return self._description
