"""The driver loop of a diffusion stage with ``batching="step"`` (step-level batching).

The stage's driver thread keeps a running set of requests on its workers
(:mod:`vllm_omni.diffusion.step_batching`) and, between management calls, repeats:

1. admission: queued requests join, oldest first, while the running set has fewer than
   ``max_batch_size`` requests and their adapters fit ``max_loras`` distinct adapters together (a
   request that does not fit waits, and later requests that would bring new adapters wait behind it;
   requests that add none pass). Each joins after its text encoding; one that fails there (an adapter
   that cannot load, an argument its pipeline refuses) fails alone. Requests submitted inside
   ``hold()`` join together when it ends.
2. cancellation: a request whose future was cancelled (client gone) leaves before the next step.
3. one denoiser step for the running requests of one latent shape (shapes take turns); the requests
   that finished leave, their futures resolve.

Futures stay cancellable while their request runs (they never enter the ``RUNNING`` state). The stage's
statistics gain the running requests (``StageStats.running``) and the samples of every denoiser call
(``StageStats.step_batch``); ``queue`` is the wait before a request joined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from concurrent.futures import InvalidStateError
from typing import Any

from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.step_batching import step_admit, step_reset, step_run
from vllm_omni.engine.stage_driver import StageDriver
from vllm_omni.errors import StageDeadError

logger = logging.getLogger(__name__)


class StepScheduling(StageDriver):
    """Mixin of :class:`~vllm_omni.engine.diffusion_stage.DiffusionStageEngine`: the step-level loop
    (module docstring). Uses the driver's ``_queue``, ``_cv``, ``_commands``, ``_holds``, ``recorder``
    and the stage's ``_engine``, ``max_batch_size``, ``max_loras``, ``batch_sizes``, ``_record``."""

    # provided by DiffusionStageEngine
    _engine: DiffusionEngine
    max_batch_size: int
    batch_sizes: list[int]
    max_loras: int

    def _record(self, item: Any, started: float, result: Any) -> None:
        raise NotImplementedError

    def _take_worker_stats(self) -> None:
        raise NotImplementedError

    def _init_steps(self) -> None:
        #: request id -> (pending item, monotonic time it joined)
        self._running: dict[int, tuple[Any, float]] = {}
        self._next_rid = 0
        self._steps_since_stats = 0

    def _drive_steps(self) -> None:
        while True:
            with self._cv:
                while not (
                    self._closed or self._commands or (self._queue and self._holds == 0) or self._running
                ):
                    self._cv.wait()
                if self._closed:
                    return
                commands, self._commands = self._commands, []
                joining = self._take_joining() if self._queue and self._holds == 0 else []
            self._run_commands(commands)
            if commands:
                self._take_worker_stats()
            try:
                if joining:
                    self._join(joining)
                if self._running:
                    self._one_step()
            except Exception as exc:  # a dead stage, or a fault outside any one request
                self._fail_running(exc)

    # ------------------------------------------------------------------ admission
    def _take_joining(self) -> list[Any]:
        """Remove from the queue (under the lock) the requests that join now (module docstring)."""
        ids = {a.lora.lora_int_id for item, _ in self._running.values() for a in item.adapters}
        room = self.max_batch_size - len(self._running)
        joining: list[Any] = []
        rest: list[Any] = []
        blocked = False
        for item in self._queue:
            if item.future.cancelled():
                continue
            new = {a.lora.lora_int_id for a in item.adapters} - ids
            alone = not self._running and not joining  # always runs (its own adapters are checked at join)
            if len(joining) >= room or (new and not alone and (blocked or len(ids | new) > self.max_loras)):
                blocked = blocked or bool(new)
                rest.append(item)
                continue
            joining.append(item)
            ids |= new
        self._queue.clear()
        self._queue.extend(rest)
        return joining

    def _join(self, items: list[Any]) -> None:
        now = time.monotonic()
        requests = []
        for item in items:
            rid, self._next_rid = self._next_rid, self._next_rid + 1
            params = dataclasses.replace(item.params, seed=None, lora_requests=[], lora_scales=[])
            requests.append((rid, item.prompt, params, item.adapters, item.seed))
        try:
            errors = self._engine.collective_rpc(step_admit, requests)[0]
        except Exception as exc:
            for item in items:
                self._resolve(item, now, exc)
            raise
        for (rid, *_), item, error in zip(requests, items, errors, strict=True):
            if error is None:
                self._running[rid] = (item, now)
            else:
                self._resolve(item, now, error)
        self._take_worker_stats()
        self.recorder.running(len(self._running))

    # ------------------------------------------------------------------ steps
    def _one_step(self) -> None:
        cancelled = [rid for rid, (item, _) in self._running.items() if item.future.cancelled()]
        for rid in cancelled:
            self._running.pop(rid)
        result = self._engine.collective_rpc(step_run, cancelled)[0]
        for rid, output in result["finished"]:
            item, joined = self._running.pop(rid)
            self._resolve(item, joined, output)
        self.batch_sizes.append(result["rows"])
        self.recorder.step_batch(result["rows"])
        self.recorder.running(len(self._running))
        self._steps_since_stats += 1
        # the worker's events (step seconds, adapter loads) every few steps and when requests leave: with
        # several ranks a collection is one more round trip
        if result["finished"] or self._steps_since_stats >= 8:
            self._take_worker_stats()
            self._steps_since_stats = 0

    def _resolve(self, item: Any, joined: float, result: Any) -> None:
        self._record(item, joined, result)
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)

    def _fail_running(self, exc: BaseException) -> None:
        """Fail every running request with ``exc`` (a dead stage also stops serving)."""
        logger.warning("%s: step batch of %d failed: %s", self.stage.label, len(self._running), exc)
        if isinstance(exc, StageDeadError):
            with self._cv:
                self._dead = exc
        else:
            with contextlib.suppress(Exception):
                self._engine.collective_rpc(step_reset)
        running, self._running = self._running, {}
        for item, joined in running.values():
            self._resolve(item, joined, exc)
        self.recorder.running(0)

    def _running_items(self) -> Iterator[Any]:
        """The pending items of the running requests, read when iterated (``shutdown`` fails them
        after the driver thread stopped)."""
        for item, _ in list(self._running.values()):
            yield item


__all__ = ["StepScheduling"]
