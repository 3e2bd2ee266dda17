"""The stage worker process of the ``mp`` backend.

:func:`worker_main` runs in a process forked from the preloaded worker interpreter or in a
spawned one (:mod:`~vllm_omni.worker_start`), with its env dict (device visibility, CPU
threads) already applied; it sets the dict again, starts the parent watch of
:mod:`vllm_omni.process_guard` (the worker exits when the orchestrator's process is gone,
SIGKILL included), builds the stage's ordinary inline runtime and serves the messages of
:mod:`~vllm_omni.engine.workers.protocol` until :class:`~.protocol.Shutdown` or the end of the pipe.
Requests resolve on the runtime's own threads, which send their outputs back under a lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing.util
import os
import signal
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from vllm_omni import worker_start as start
from vllm_omni.engine.inline_runtime import RuntimeFactory, make_inline_runtime, worker_process_defaults
from vllm_omni.engine.vllm_process import exit_follows_shutdown
from vllm_omni.engine.workers import protocol as P
from vllm_omni.process_guard import watch_parent

logger = logging.getLogger(__name__)

#: Runtime calls answered on the receiving thread: they never wait for the engine (a statistics
#: scrape must not queue behind an adapter call that waits for a running batch).
_IMMEDIATE_CALLS = frozenset({"stats"})


class _Worker:
    """Serves one runtime over one pipe."""

    def __init__(self, conn: Connection, runtime: Any) -> None:
        self.conn = conn
        self.runtime = runtime
        self._send_lock = threading.Lock()
        self._requests: dict[int, Future] = {}
        self._holds: list[contextlib.AbstractContextManager] = []
        # LoRA and validation calls may wait for a running batch: off the receiving thread,
        # one at a time (in the order they were sent)
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-worker-call")

    def send(self, msg: Any) -> None:
        frame = P.encode(msg)
        with self._send_lock, contextlib.suppress(OSError):  # the parent is gone: the watch ends us
            self.conn.send_bytes(frame)

    def serve(self) -> float | None:
        """Handle messages until shutdown (its timeout) or the end of the pipe (``None``)."""
        while True:
            try:
                msg = P.decode_to_worker(self.conn.recv_bytes())
            except (EOFError, OSError):
                return None
            if isinstance(msg, P.Submit):
                self._submit(msg)
            elif isinstance(msg, P.Abort):
                fut = self._requests.get(msg.rid)
                if fut is not None:
                    fut.cancel()
            elif isinstance(msg, P.Call) and msg.method in _IMMEDIATE_CALLS:
                self._call(msg)
            elif isinstance(msg, P.Call):
                self._calls.submit(self._call, msg)
            elif isinstance(msg, P.Hold):
                hold = self.runtime.hold()
                hold.__enter__()
                self._holds.append(hold)
            elif isinstance(msg, P.Release):
                if self._holds:
                    self._holds.pop().__exit__(None, None, None)
            elif isinstance(msg, P.Shutdown):
                return msg.timeout

    def _submit(self, msg: P.Submit) -> None:
        rid = msg.rid
        try:
            request = P.load(msg.payload)
            if msg.stream:
                request = dataclasses.replace(
                    request, on_partial=lambda out: self.send(P.Partial(rid, P.dump(out)))
                )
            fut = self.runtime.submit(request)
        except Exception as exc:
            self.send(P.Failed(rid, P.dump_error(exc)))
            return
        self._requests[rid] = fut
        self.send(P.Accepted(rid))
        fut.add_done_callback(lambda f: self._finish(rid, f))

    def _finish(self, rid: int, fut: Future) -> None:
        self._requests.pop(rid, None)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.send(P.Failed(rid, P.dump_error(exc)))
            return
        try:
            payload = P.dump(fut.result())
        except Exception as err:  # an output that cannot cross fails its own request
            self.send(P.Failed(rid, P.dump_error(err)))
            return
        self.send(P.Output(rid, payload))

    def _call(self, msg: P.Call) -> None:
        try:
            args, kwargs = P.load(msg.payload)
            result = getattr(self.runtime, msg.method)(*args, **kwargs)
            reply = P.CallResult(msg.cid, True, P.dump(result))
        except Exception as exc:
            reply = P.CallResult(msg.cid, False, P.dump_error(exc))
        self.send(reply)

    def close(self, timeout: float | None) -> None:
        while self._holds:
            self._holds.pop().__exit__(None, None, None)
        self._calls.shutdown(wait=False, cancel_futures=True)
        self.runtime.shutdown(timeout)


def worker_main(
    conn: Connection,
    stage: Any,
    env: dict[str, str] | None = None,
    config: Any = None,
    factory: RuntimeFactory | None = None,
) -> None:
    """Entry point of a stage worker process (``multiprocessing`` spawn target).

    Args:
        conn: this end of the pipe to the orchestrator's process.
        stage: the stage's resolved config (picklable).
        env: variables set before torch / vLLM are imported (e.g. ``CUDA_VISIBLE_DEVICES``).
        config: the whole pipeline config (picklable), read by the stage runtimes that need it.
        factory: the stage's registered runtime factory (``inline_runtime.runtime_factory``; a
            top-level function, pickled by reference), ``None`` for vLLM / diffusion stages.

    Sends :class:`~.protocol.Ready` once the runtime runs, or :class:`~.protocol.Failed`
    (``rid`` -1, the start-up error) and exits.
    """
    os.environ.update(env or {})
    worker_process_defaults()
    exit_follows_shutdown()  # this process ends right after its runtime shuts down (below)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the owner, which shuts us down

    watch_parent()
    try:
        runtime = make_inline_runtime(stage, config, factory)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send_bytes(P.encode(P.Failed(-1, P.dump_error(exc, f"{stage.label} worker"))))
        return
    worker = _Worker(conn, runtime)
    torch = sys.modules.get("torch")  # imported by every runtime; not imported here otherwise
    threads = torch.get_num_threads() if torch is not None else 0
    worker.send(P.Ready(os.getpid(), threads, start.preloaded_at_entry))
    timeout = worker.serve()
    worker.close(timeout)
    # the runtime released everything it started; skip the interpreter's teardown (seconds of
    # module finalisation for torch / vLLM) so that shutdown is bounded by the runtime's own
    # multiprocessing's exit finalizers still run: they unlink this process's named semaphores
    # (tqdm's write lock, vLLM's), which the resource tracker would otherwise report as leaked
    with contextlib.suppress(Exception):
        multiprocessing.util._run_finalizers()  # type: ignore[attr-defined]  # private: no public API runs them
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
