"""``WorkerStageRuntime``: a stage whose runtime runs in a worker process (``worker_backend: mp``).

It implements :class:`~vllm_omni.engine.protocols.StageRuntime` by forwarding every call to
the worker (:mod:`~vllm_omni.engine.workers.mp`) over the messages of
:mod:`~vllm_omni.engine.workers.protocol`. A reader thread takes the worker's replies; request
futures are resolved (and streamed pieces handed on) by one dispatch thread, in arrival order,
so callbacks that submit to the next stage never block the reader.

Supervision (health, the restart policy of the stage, adapter replay, in-flight failures and
reaping every worker started) is :class:`~vllm_omni.engine.workers.supervisor.SupervisedStageRuntime`'s;
this module only moves messages. The worker's death is seen when the pipe ends or the
process exits; the error names the stage, the pid and the exit code or signal.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vllm_omni import worker_start as start
from vllm_omni.engine.workers import protocol as P
from vllm_omni.engine.workers.mp import worker_main
from vllm_omni.engine.workers.supervisor import Pending, SupervisedStageRuntime
from vllm_omni.errors import StageDeadError, StageEngineError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.process_guard import join_exit, mark_owner

logger = logging.getLogger(__name__)

#: Seconds a worker may take to start its runtime (model load included).
START_TIMEOUT_S = 900.0
#: Seconds ``shutdown()`` waits for the worker when no timeout is given.
SHUTDOWN_WAIT_S = 120.0

#: Seconds between "still starting" log lines while a worker loads its stage.
PROGRESS_EVERY_S = 30.0
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


@dataclass(eq=False)
class _Worker:
    proc: Any
    conn: Any
    generation: int
    send_lock: Any


class WorkerStageRuntime(SupervisedStageRuntime):
    """One stage served by a spawned worker process.

    Args:
        stage: the resolved stage config (sent to the worker, which builds the inline runtime).
        env: environment variables the worker sets before importing torch / vLLM
            (e.g. ``CUDA_VISIBLE_DEVICES`` from the stage's placement); ``None``: none.
        config: the whole pipeline config, for the stage runtimes that read it (the Qwen2.5-Omni
            talker reads its thinker stage's options).
        factory: the stage's registered runtime factory (``inline_runtime.runtime_factory``),
            handed to the worker; ``None`` for vLLM / diffusion stages.

    Raises:
        StageEngineError (or the runtime's own start-up error class): the worker failed to start.
    """

    def __init__(
        self, stage: Any, env: dict[str, str] | None = None, config: Any = None, factory: Any = None
    ) -> None:
        global _atexit_registered
        super().__init__(stage)
        self.env = dict(env or {})
        self.config = config
        self.factory = factory
        #: ``torch.get_num_threads()`` in the worker once its runtime started (0: unknown)
        self.torch_threads = 0
        #: how the serving worker started: ``"forkserver"`` or ``"spawn"`` (``start.process_for``)
        self.start_method = ""
        #: whether the serving worker found vLLM already imported when it began (forked preloaded)
        self.preloaded = False
        self._ids = itertools.count()
        self._generation = 0
        self._dispatch = ThreadPoolExecutor(1, thread_name_prefix=f"omni-stage-{stage.stage_id}-dispatch")
        mark_owner()  # the worker (and its children) exit with this process (process_guard)
        if not _atexit_registered:
            _atexit_registered = True
            atexit.register(_shutdown_live)
        _LIVE.add(self)
        start.hold(self)  # the fork server stays while this runtime may start workers
        try:
            self._begin()
        except BaseException:
            _LIVE.discard(self)
            self._dispatch.shutdown(wait=False)
            start.release(self)
            raise

    # ---------------------------------------------------------------- StageRuntime
    @property
    def pid(self) -> int | None:
        """The serving worker's process id (``None`` before the first start)."""
        return self._handle.proc.pid if self._handle is not None else None

    def submit(self, request: StageRequest) -> Future:
        """Queue one request in the worker (see ``StageRuntime.submit``): the worker's checks
        run before this returns and raise here with their own class. ``request.on_partial`` (LLM
        stages) stays in this process: the worker streams pieces back and the dispatch thread
        calls it with each.

        Raises:
            StageDeadError: the worker died (or is being restarted); StageEngineError: shut down;
            AdapterRestoreError: the request names an adapter the last restart could not restore.
        """
        self.check_adapters(request)
        on_partial = request.on_partial
        rid = next(self._ids)
        worker = self._serving()
        ack: Future = Future()
        req = Pending(on_partial, ack=ack, handle=worker)
        self._track(rid, req)
        try:
            wire = dataclasses.replace(request, on_partial=None)
            self._send(worker, P.Submit(rid, P.dump(wire), on_partial is not None))
            ack.result()
        except BaseException:
            self._untrack(rid)
            raise
        req.future.add_done_callback(lambda f: self._on_done(worker, rid, f))
        return req.future

    def validate_request(self, request: StageRequest) -> None:
        """The worker's ``validate_request`` (same checks, same errors)."""
        self.check_adapters(request)
        self._call("validate_request", dataclasses.replace(request, on_partial=None))

    def prepare_params(self, params: Any) -> Any:
        return self._call("prepare_params", params)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Requests submitted inside the block start together in the worker when it exits."""
        try:
            worker = self._serving()
            self._send(worker, P.Hold())
        except StageEngineError:
            worker = None
        try:
            yield
        finally:
            if worker is not None:
                with contextlib.suppress(StageEngineError):
                    self._send(worker, P.Release())

    def _after_shutdown(self) -> None:
        _LIVE.discard(self)
        self._dispatch.shutdown(wait=False)
        start.release(self)  # the last one of this process ends the fork server

    # ---------------------------------------------------------------- calls and messages
    def _worker_call(self, handle: Any, method: str, *args: Any) -> Any:
        return self._call_kw(method, args, {}, handle)

    def _call_kw(self, method: str, args: tuple, kwargs: dict, worker: Any = None) -> Any:
        """Run ``method`` in ``worker`` (default: the serving one) and return its result (its error raised here)."""
        worker = worker or self._serving()
        cid = ("call", next(self._ids))
        pending = Pending(handle=worker)
        self._track(cid, pending)
        try:
            self._send(worker, P.Call(cid[1], method, P.dump((args, kwargs))))
        except BaseException:
            self._untrack(cid)
            raise
        return pending.future.result()

    def _send(self, worker: _Worker, msg: Any) -> None:
        frame = P.encode(msg)
        try:
            with worker.send_lock:
                worker.conn.send_bytes(frame)
        except (OSError, AttributeError, ValueError) as exc:
            raise StageDeadError(f"{self.stage.label}: worker process is gone ({exc})") from exc

    def _on_done(self, worker: _Worker, rid: int, fut: Future) -> None:
        """Done-callback of a request's future: a cancelled one is aborted in the worker."""
        if fut.cancelled():
            self._untrack(rid)
            with contextlib.suppress(StageEngineError):
                self._send(worker, P.Abort(rid))

    def _handle_reply(self, worker: _Worker, msg: Any) -> None:
        """One reply of the worker (reader thread)."""
        if isinstance(msg, P.CallResult):
            pending = self._untrack(("call", msg.cid))
            if pending is not None:
                if msg.ok:
                    pending.future.set_result(P.load(msg.payload))
                else:
                    pending.future.set_exception(P.load_error(msg.payload))
            return
        with self._lock:
            req = self._in_flight.get(msg.rid)
            if req is not None and isinstance(msg, P.Output | P.Failed):
                del self._in_flight[msg.rid]
        if req is None:
            return
        ack = req.ack  # set for requests (the messages below are answers to a Submit)
        if isinstance(msg, P.Accepted) and ack is not None:
            ack.set_result(None)
        elif isinstance(msg, P.Failed) and ack is not None and not ack.done():
            ack.set_exception(P.load_error(msg.error))
        elif isinstance(msg, P.Failed):
            self._dispatch.submit(_resolve, req.future, None, P.load_error(msg.error))
        elif isinstance(msg, P.Output):
            self._dispatch.submit(_resolve, req.future, msg.payload, None)
        elif isinstance(msg, P.Partial):
            self._dispatch.submit(self._partial, worker, msg.rid, req, msg.payload)

    def _partial(self, worker: _Worker, rid: int, req: Pending, payload: bytes) -> None:
        """Hand one streamed piece on; a consumer that raises fails (and aborts) its own request."""
        if req.future.done():
            return
        try:
            req.on_partial(P.load(payload))
        except Exception as exc:
            logger.warning("%s: streaming consumer failed: %s", self.stage.label, exc)
            with contextlib.suppress(InvalidStateError):
                req.future.set_exception(exc)
            self._untrack(rid)
            with contextlib.suppress(StageEngineError):
                self._send(worker, P.Abort(rid))

    # ---------------------------------------------------------------- worker life
    def _describe(self, handle: Any) -> str:
        return f"pid {handle.proc.pid}"

    def _start_worker(self) -> _Worker:
        """Start a worker and wait for its runtime (raises its start-up error; nothing is left running).

        The worker is forked from the preloaded worker interpreter, or spawned as a fresh one
        (:mod:`~vllm_omni.worker_start`: which, and how its ``env`` takes effect).
        """
        parent, child = multiprocessing.Pipe()
        proc, how = start.process_for(
            self.stage.label,
            worker_main,
            (child, self.stage, self.env, self.config, self.factory),
            self.env,
            name=f"omni-stage-{self.stage.stage_id}",
        )
        start.start_process(proc, how, self.env)
        self.start_method = how
        child.close()
        self._generation += 1
        worker = _Worker(proc, parent, self._generation, threading.Lock())
        try:
            self._wait_ready(worker)
        except BaseException:
            _reap(worker, 0.0)
            raise
        threading.Thread(
            target=self._read, args=(worker,), name=f"omni-stage-{self.stage.stage_id}-reader", daemon=True
        ).start()
        return worker

    def _stop_worker(self, worker: _Worker, timeout: float | None) -> None:
        """Ask the worker to shut its runtime down, wait at most ``timeout`` seconds
        (``None``: :data:`SHUTDOWN_WAIT_S`), then kill it and close the pipe."""
        if worker.proc.is_alive():
            with contextlib.suppress(StageEngineError):
                self._send(worker, P.Shutdown(timeout))
        _reap(worker, SHUTDOWN_WAIT_S if timeout is None else timeout, self.stage.label)

    def _wait_ready(self, worker: _Worker) -> None:
        """Wait for the worker's ``Ready``; the log says when it started, every
        :data:`PROGRESS_EVERY_S` seconds that it is still starting, and when it is ready."""
        started = time.monotonic()
        deadline = started + START_TIMEOUT_S
        label = self.stage.label
        logger.info("%s: worker process %d started; loading the stage", label, worker.proc.pid)
        next_note = started + PROGRESS_EVERY_S
        while time.monotonic() < deadline:
            if time.monotonic() >= next_note:
                next_note += PROGRESS_EVERY_S
                logger.info(
                    "%s: worker %d still starting (%.0f s)",
                    label,
                    worker.proc.pid,
                    time.monotonic() - started,
                )
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
                self.torch_threads, self.preloaded = msg.torch_threads, msg.preloaded
                logger.info(
                    "%s: worker %d ready in %.1f s (%d torch thread(s); %s)",
                    label,
                    msg.pid,
                    time.monotonic() - started,
                    msg.torch_threads,
                    "forked preloaded" if msg.preloaded else "fresh interpreter",
                )
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
                self._handle_reply(worker, P.decode_from_worker(frame))
            except Exception:
                logger.exception("%s: bad reply from the worker", self.stage.label)
        if worker.proc.is_alive() and not self._closed.is_set():
            worker.proc.kill()
        worker.proc.join(5.0)
        self._worker_died(worker, describe_exit(worker.proc.exitcode))


def _reap(worker: _Worker, wait_s: float, label: str = "") -> None:
    """Wait at most ``wait_s`` seconds for the worker to exit, kill it if it has not, close its pipe."""
    if not join_exit(worker.proc, wait_s):
        if wait_s:
            logger.warning("%s: worker %d did not stop in %.1f s; killing it", label, worker.proc.pid, wait_s)
        worker.proc.kill()
        worker.proc.join(5.0)
    with contextlib.suppress(OSError):
        worker.conn.close()


def _resolve(fut: Future, payload: bytes | None, error: BaseException | None) -> None:
    """Resolve a request's future on the dispatch thread (a cancelled one stays cancelled): with
    ``error``, or else with the object pickled in ``payload``."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        elif payload is not None:
            fut.set_result(P.load(payload))
