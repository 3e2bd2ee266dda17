"""The thread-owned skeleton shared by the stage runtimes.

A stage runtime owns one engine and one driver thread; every engine call runs on that
thread. Callers queue requests (the subclass decides how they are batched) and
management calls (``add_lora`` ...), and wait on ``concurrent.futures.Future`` objects,
so the blocking ``Omni`` and the asyncio ``AsyncOmni`` share one runtime.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from vllm_omni.errors import StageEngineError
from vllm_omni.stats import StageStats, StatsRecorder


class StageDriver:
    """Queue, management calls, holds and shutdown of a stage's driver thread.

    Subclasses call :meth:`_init_driver` before starting their thread, run
    :meth:`_run_commands` from their loop, and :meth:`_stop_driver` from ``shutdown``.
    ``self.stage.label`` names the stage in errors.
    """

    stage: Any

    def _init_driver(self) -> None:
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._holds = 0
        self._dead: BaseException | None = None
        self._closed = False
        #: what ``stats()`` reports; fed by the runtime (never by the driver loop's callers)
        self.recorder = StatsRecorder(self.stage.stage_id, self.stage.stage_type)

    def stats(self) -> StageStats:
        """A snapshot of the stage's statistics (:class:`~vllm_omni.stats.StageStats`). Never waits
        for the driver thread: callable while a batch or a step runs."""
        return self.recorder.snapshot()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Requests submitted inside this block start together when it exits (one batch / step)."""
        with self._cv:
            self._holds += 1
        try:
            yield
        finally:
            with self._cv:
                self._holds -= 1
                self._cv.notify()

    def prepare_params(self, params: Any) -> Any:
        """``params`` unchanged; runtimes that convert params once for many requests override this."""
        return params

    def health(self) -> str:
        """``"ready"``, or ``"dead"`` once the stage failed fatally or was shut down."""
        return "dead" if self._closed or self._dead is not None else "ready"

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise StageEngineError(f"{self.stage.label} is shut down")
        if self._dead is not None:
            raise StageEngineError(f"{self.stage.label} failed earlier and cannot serve: {self._dead}")

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the driver thread (between engine steps / batches) and return its result."""
        fut: Future = Future()
        with self._cv:
            self._raise_if_unusable()
            self._commands.append((fn, fut))
            self._cv.notify()
        return fut.result()

    def _next_work(
        self, take: Callable[[], Any]
    ) -> tuple[list[tuple[Callable[[], Any], Future]], Any] | None:
        """Wait for work: ``(commands, taken)`` once there are management calls or queued
        requests outside a :meth:`hold`, ``None`` once the driver is closed.

        ``take()`` runs under the lock when requests are queued and nothing holds them, and
        removes what the loop runs next (one item, or a batch); ``taken`` is ``None`` otherwise.
        """
        with self._cv:
            while not (self._closed or self._commands or (self._queue and self._holds == 0)):
                self._cv.wait()
            if self._closed:
                return None
            commands, self._commands = self._commands, []
            return commands, take() if self._queue and self._holds == 0 else None

    @staticmethod
    def _run_commands(commands: Iterable[tuple[Callable[[], Any], Future]]) -> None:
        for fn, fut in commands:
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _fail_commands(self, err: BaseException) -> None:
        """Answer the calls the driver will never run (it stopped), so no caller waits forever."""
        with self._cv:
            commands, self._commands = self._commands, []
        for _, fut in commands:
            if not fut.done():
                fut.set_exception(err)

    def _stop_driver(self, thread: threading.Thread, timeout: float, pending: Iterable[Any] = ()) -> bool:
        """Stop the loop, join ``thread`` and fail queued items, ``pending`` ones and calls.

        Returns:
            ``False`` when the driver was already stopped (nothing was done).
        """
        with self._cv:
            if self._closed:
                return False
            self._closed = True
            self._cv.notify()
        thread.join(timeout=timeout)
        err = StageEngineError(f"{self.stage.label}: shut down")
        for item in [*self._queue, *pending]:
            if not item.future.done():
                item.future.set_exception(err)
        self._queue.clear()
        self._fail_commands(err)
        return True
