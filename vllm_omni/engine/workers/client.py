"""``WorkerStageRuntime``: a stage whose runtime runs in a worker process (``worker_backend: mp``).

It implements :class:`~vllm_omni.engine.protocols.StageRuntime` by forwarding every call to
the worker (:mod:`~vllm_omni.engine.workers.mp`) over the messages of
:mod:`~vllm_omni.engine.workers.protocol`. A reader thread takes the worker's replies; request
futures are resolved (and streamed pieces handed on) by one dispatch thread, in arrival order,
so callbacks that submit to the next stage never block the reader.

Fault isolation. When the worker dies (killed, crashed, out of memory: the pipe ends or the
process exits), the requests and calls in flight on this stage fail with
:class:`~vllm_omni.errors.StageDeadError` naming the stage, the pid and the exit code or
signal; other stages keep serving. While the stage is down, ``submit`` raises the same error at
once. The worker is then restarted: up to :data:`RESTART_ATTEMPTS` tries per failure, waiting
:data:`BACKOFF_S` × 2^try seconds before each (at most :data:`BACKOFF_MAX_S`), at most
:data:`MAX_RESTARTS` restarts over the runtime's life; the adapters added at run time and the
pins are replayed (:class:`~vllm_omni.engine.workers.lora_journal.LoRAJournal`). Health:
``"ready"``, ``"restarting"`` or ``"dead"`` (gave up, or shut down).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import multiprocessing
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.utils.system_utils import set_env_var

from vllm_omni.engine.workers import protocol as P
from vllm_omni.engine.workers.lora_journal import LoRAJournal
from vllm_omni.engine.workers.mp import worker_main
from vllm_omni.errors import StageDeadError, StageEngineError
from vllm_omni.process_guard import mark_owner

logger = logging.getLogger(__name__)

#: Tries to restart a dead worker before the stage is declared dead.
RESTART_ATTEMPTS = 3
#: Restarts a stage may have over its life (a crash loop ends as ``dead``).
MAX_RESTARTS = 10
#: Seconds before the first restart try (doubled per try, capped at :data:`BACKOFF_MAX_S`).
BACKOFF_S = 0.5
BACKOFF_MAX_S = 10.0
#: Seconds a worker may take to start its runtime (model load included).
START_TIMEOUT_S = 900.0
#: Seconds ``shutdown()`` waits for the worker when no timeout is given.
SHUTDOWN_WAIT_S = 120.0

#: Held while a worker is spawned with its env in this process's environment.
_SPAWN_LOCK = threading.Lock()
_LIVE: weakref.WeakSet[WorkerStageRuntime] = weakref.WeakSet()
_atexit_registered = False


def describe_exit(exitcode: int | None) -> str:
    """``"killed by signal SIGKILL"`` / ``"exit code 1"`` for a process's exit code."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _shutdown_live() -> None:
    """At interpreter exit: stop the workers nobody shut down (their processes are not daemonic)."""
    for runtime in list(_LIVE):
        with contextlib.suppress(Exception):
            runtime.shutdown(5.0)


@dataclass
class _Request:
    on_partial: Callable[[Any], None] | None
    future: Future = field(default_factory=Future)
    ack: Future = field(default_factory=Future)  # submit's synchronous answer


@dataclass
class _Worker:
    proc: Any
    conn: Any
    generation: int


class WorkerStageRuntime:
    """One stage served by a spawned worker process.

    Args:
        stage: the resolved stage config (sent to the worker, which builds the inline runtime).
        env: environment variables the worker sets before importing torch / vLLM
            (e.g. ``CUDA_VISIBLE_DEVICES`` from the stage's placement); ``None``: none.

    Raises:
        StageEngineError (or the runtime's own start-up error class): the worker failed to start.
    """

    def __init__(self, stage: Any, env: dict[str, str] | None = None) -> None:
        global _atexit_registered
        self.stage = stage
        self.env = dict(env or {})
        self.journal = LoRAJournal()
        self._description: Any = None
        self.restarts = 0
        #: ``torch.get_num_threads()`` in the worker once its runtime started (0: unknown)
        self.torch_threads = 0
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._requests: dict[int, _Request] = {}
        self._calls: dict[int, Future] = {}
        self._health = "restarting"
        self._last_death = ""
        self._closed = threading.Event()
        self._worker: _Worker | None = None
        self._generation = 0
        self._dispatch = ThreadPoolExecutor(1, thread_name_prefix=f"omni-stage-{stage.stage_id}-dispatch")
        mark_owner()  # the worker (and its children) exit with this process (process_guard)
        if not _atexit_registered:
            _atexit_registered = True
            atexit.register(_shutdown_live)
        self._spawn()
        self._health = "ready"
        _LIVE.add(self)

    # ---------------------------------------------------------------- StageRuntime
    @property
    def pid(self) -> int | None:
        """The worker's process id (``None`` before the first start)."""
        return self._worker.proc.pid if self._worker is not None else None

    def health(self) -> str:
        """``"ready"``, ``"restarting"`` (worker died, being replaced) or ``"dead"``."""
        return "dead" if self._closed.is_set() else self._health

    def submit(self, prompt: Any, params: Any, lora_request: Any = None, on_partial=None, **kwargs) -> Future:
        """Queue one request in the worker (see ``StageRuntime.submit``): the worker's checks
        run before this returns and raise here with their own class. ``on_partial`` (LLM
        stages) is called on the dispatch thread with each streamed piece.

        Raises:
            StageDeadError: the worker died (or is being restarted); StageEngineError: shut down.
        """
        if lora_request is not None:
            kwargs["lora_request"] = lora_request
        rid = next(self._ids)
        req = _Request(on_partial)
        with self._lock:
            self._check_serving()
            self._requests[rid] = req
        try:
            self._send(P.Submit(rid, P.dump((prompt, params, kwargs)), on_partial is not None))
            req.ack.result()
        except BaseException:
            with self._lock:
                self._requests.pop(rid, None)
            raise
        req.future.add_done_callback(lambda f: self._on_done(rid, f))
        return req.future

    def validate_request(self, prompt: Any, params: Any, lora_request: Any = None, **kwargs: Any) -> None:
        """The worker's ``validate_request`` (same checks, same errors)."""
        if lora_request is not None:
            kwargs["lora_request"] = lora_request
        self._call("validate_request", prompt, params, **kwargs)

    def prepare_params(self, params: Any) -> Any:
        return self._call("prepare_params", params)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Requests submitted inside the block start together in the worker when it exits."""
        try:
            self._send(P.Hold())
            held = True
        except StageEngineError:
            held = False
        try:
            yield
        finally:
            if held:
                with contextlib.suppress(StageEngineError):
                    self._send(P.Release())

    def add_lora(self, lora_request: Any) -> bool:
        return self._journaled("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._journaled("remove_lora", lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self._call("list_loras"))

    def describe(self) -> Any:
        """The worker runtime's ``StageDescription`` (asked once, then kept: a restarted worker
        runs the same stage config)."""
        if self._description is None:
            self._description = self._call("describe")
        return self._description

    def pin_lora(self, lora_int_id: int) -> bool:
        return self._journaled("pin_lora", lora_int_id)

    def stats(self) -> Any:
        """The worker runtime's statistics snapshot (answered at once, even while a batch runs)."""
        return self._call("stats")

    def shutdown(self, timeout: float | None = None) -> None:
        """Ask the worker to shut its runtime down, wait at most ``timeout`` seconds
        (``None``: :data:`SHUTDOWN_WAIT_S`), then kill it; what is in flight fails with ``StageEngineError``."""
        if self._closed.is_set():
            return
        self._closed.set()
        _LIVE.discard(self)
        wait_s = SHUTDOWN_WAIT_S if timeout is None else timeout
        worker = self._worker
        if worker is not None:
            with contextlib.suppress(StageEngineError):
                self._send(P.Shutdown(timeout))
            worker.proc.join(wait_s)
            if worker.proc.is_alive():
                logger.warning(
                    "%s: worker %d did not stop in %.1f s; killing it",
                    self.stage.label,
                    worker.proc.pid,
                    wait_s,
                )
                worker.proc.kill()
                worker.proc.join(5.0)
            worker.conn.close()
        self._fail_in_flight(StageEngineError(f"{self.stage.label}: shut down"))
        self._dispatch.shutdown(wait=False)

    # ---------------------------------------------------------------- calls and messages
    def _check_serving(self) -> None:
        if self._closed.is_set():
            raise StageEngineError(f"{self.stage.label} is shut down")
        if self._health != "ready":
            raise StageDeadError(
                f"{self.stage.label} is {self._health}: its worker process died ({self._last_death})"
            )

    def _journaled(self, method: str, arg: Any) -> Any:
        result = self._call(method, arg)
        self.journal.record(method, (arg,))
        return result

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._check_serving()
        return self._call_worker(method, *args, **kwargs)

    def _call_worker(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` in the current worker and return its result (its error raised here)."""
        cid = next(self._ids)
        fut: Future = Future()
        with self._lock:
            self._calls[cid] = fut
        try:
            self._send(P.Call(cid, method, P.dump((args, kwargs))))
        except BaseException:
            with self._lock:
                self._calls.pop(cid, None)
            raise
        return fut.result()

    def _send(self, msg: Any) -> None:
        worker = self._worker
        frame = P.encode(msg)
        try:
            with self._send_lock:
                worker.conn.send_bytes(frame)
        except (OSError, AttributeError) as exc:
            raise StageDeadError(f"{self.stage.label}: worker process is gone ({exc})") from exc

    def _on_done(self, rid: int, fut: Future) -> None:
        """Done-callback of a request's future: a cancelled one is aborted in the worker."""
        if fut.cancelled():
            with self._lock:
                self._requests.pop(rid, None)
            with contextlib.suppress(StageEngineError):
                self._send(P.Abort(rid))

    def _handle(self, msg: Any) -> None:
        """One reply of the worker (reader thread)."""
        if isinstance(msg, P.CallResult):
            with self._lock:
                fut = self._calls.pop(msg.cid, None)
            if fut is not None:
                if msg.ok:
                    fut.set_result(P.load(msg.payload))
                else:
                    fut.set_exception(P.load_error(msg.payload))
            return
        with self._lock:
            req = self._requests.get(msg.rid)
            if req is not None and isinstance(msg, P.Output | P.Failed) and req.ack.done():
                del self._requests[msg.rid]
        if req is None:
            return
        if isinstance(msg, P.Accepted):
            req.ack.set_result(None)
        elif isinstance(msg, P.Failed) and not req.ack.done():
            with self._lock:
                self._requests.pop(msg.rid, None)
            req.ack.set_exception(P.load_error(msg.error))
        elif isinstance(msg, P.Failed):
            self._dispatch.submit(_resolve, req.future, None, P.load_error(msg.error))
        elif isinstance(msg, P.Output):
            self._dispatch.submit(_resolve, req.future, msg.payload, None)
        elif isinstance(msg, P.Partial):
            self._dispatch.submit(self._partial, msg.rid, req, msg.payload)

    def _partial(self, rid: int, req: _Request, payload: bytes) -> None:
        """Hand one streamed piece on; a consumer that raises fails (and aborts) its own request."""
        if req.future.done():
            return
        try:
            req.on_partial(P.load(payload))
        except Exception as exc:
            logger.warning("%s: streaming consumer failed: %s", self.stage.label, exc)
            with contextlib.suppress(InvalidStateError):
                req.future.set_exception(exc)
            with self._lock:
                self._requests.pop(rid, None)
            with contextlib.suppress(StageEngineError):
                self._send(P.Abort(rid))

    def _fail_in_flight(self, err: BaseException) -> None:
        with self._lock:
            requests, self._requests = self._requests, {}
            calls, self._calls = self._calls, {}
        for req in requests.values():
            for fut in (req.ack, req.future):
                with contextlib.suppress(InvalidStateError):
                    fut.set_exception(err)
        for fut in calls.values():
            with contextlib.suppress(InvalidStateError):
                fut.set_exception(err)

    # ---------------------------------------------------------------- worker life
    def _spawn(self) -> None:
        """Start a worker and wait for its runtime (raises its start-up error).

        The worker's ``env`` is in this process's environment while the child is spawned: the
        child imports torch (unpickling its arguments) before ``worker_main`` runs, and OpenMP
        reads ``OMP_NUM_THREADS`` when it loads, so setting it in the child would be too late.
        """
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=worker_main,
            args=(child, self.stage, self.env),
            name=f"omni-stage-{self.stage.stage_id}",
            daemon=False,  # a stage's engine may start processes of its own
        )
        with _SPAWN_LOCK, contextlib.ExitStack() as env:
            for key, value in self.env.items():
                env.enter_context(set_env_var(key, value))
            proc.start()
        child.close()
        self._generation += 1
        worker = _Worker(proc, parent, self._generation)
        self._worker = worker
        try:
            self._wait_ready(worker)
        except BaseException:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
            parent.close()
            raise
        threading.Thread(
            target=self._read, args=(worker,), name=f"omni-stage-{self.stage.stage_id}-reader", daemon=True
        ).start()

    def _wait_ready(self, worker: _Worker) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        label = self.stage.label
        while time.monotonic() < deadline:
            if self._closed.is_set():
                raise StageEngineError(f"{label}: shut down while its worker was starting")
            try:
                if not worker.conn.poll(0.2):
                    if worker.proc.is_alive():
                        continue
                    raise EOFError
                msg = P.decode_from_worker(worker.conn.recv_bytes())
            except (EOFError, OSError):
                worker.proc.join(5.0)
                raise StageDeadError(
                    f"{label}: worker process {worker.proc.pid} died while starting "
                    f"({describe_exit(worker.proc.exitcode)})"
                ) from None
            if isinstance(msg, P.Ready):
                self.torch_threads = msg.torch_threads
                logger.debug("%s: worker %d ready, %d torch thread(s)", label, msg.pid, msg.torch_threads)
                return
            if isinstance(msg, P.Failed):
                raise P.load_error(msg.error)
        raise StageEngineError(f"{label}: worker did not start within {START_TIMEOUT_S:.0f} s")

    def _read(self, worker: _Worker) -> None:
        """Reader thread of one worker: replies until the pipe ends or the process exits."""
        while True:
            try:
                if not worker.conn.poll(0.5):
                    if worker.proc.is_alive():
                        continue
                    break
                frame = worker.conn.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                self._handle(P.decode_from_worker(frame))
            except Exception:
                logger.exception("%s: bad reply from the worker", self.stage.label)
        if not self._closed.is_set():
            self._on_death(worker)

    def _on_death(self, worker: _Worker) -> None:
        """Fail what was in flight, then restart (unless a restart is already trying)."""
        if worker.proc.is_alive():
            worker.proc.kill()
        worker.proc.join(5.0)
        worker.conn.close()
        self._last_death = f"pid {worker.proc.pid}, {describe_exit(worker.proc.exitcode)}"
        with self._lock:
            restarting = self._health == "restarting"
            self._health = "restarting"
        err = StageDeadError(
            f"{self.stage.label}: worker process died ({self._last_death}); its in-flight requests failed"
        )
        logger.error("%s", err)
        self._fail_in_flight(err)
        if not restarting:
            self._restart()

    def _restart(self) -> None:
        label = self.stage.label
        for attempt in range(RESTART_ATTEMPTS):
            if self.restarts >= MAX_RESTARTS:
                break
            if self._closed.wait(min(BACKOFF_S * 2**attempt, BACKOFF_MAX_S)):
                return
            self.restarts += 1
            try:
                self._spawn()
                self.journal.replay(self._call_worker)
            except Exception as exc:
                logger.error("%s: restart %d failed: %s", label, self.restarts, exc)
                continue
            with self._lock:
                if self._worker is not None and self._worker.proc.is_alive():
                    self._health = "ready"
                    logger.warning("%s: worker restarted (pid %d)", label, self._worker.proc.pid)
                    return
        with self._lock:
            self._health = "dead"
        logger.error("%s: worker could not be restarted; the stage is dead", label)


def _resolve(fut: Future, payload: bytes | None, error: BaseException | None) -> None:
    """Resolve a request's future on the dispatch thread (a cancelled one stays cancelled)."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(P.load(payload))
