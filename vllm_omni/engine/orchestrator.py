"""Runs requests through the stages of a pipeline in order.

Each stage runtime exposes ``submit(StageRequest) -> Future``. The orchestrator submits a
request to the entry stage with its adapters, and, when a stage finishes, builds the next
stage's input from its sources' outputs (the ``input_processor`` of the stage spec) and
submits it with the adapters the request gave that stage (none unless it named the stage:
per-stage request adapters).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.sampling_params import RequestOutputKind

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.engine.connectors import InProcessConnector, StageConnector
from vllm_omni.engine.cpu_threads import plan_pipeline_threads
from vllm_omni.engine.inline_runtime import check_stage_model_class
from vllm_omni.engine.protocols import LoRAMethod, StageDescription, StageRuntime
from vllm_omni.engine.stage_factory import make_stage_runtime
from vllm_omni.engine.stage_registry import input_processor
from vllm_omni.errors import (
    InvalidRequestError,
    LoRANotEnabledError,
    StageEngineError,
)
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import NO_ADAPTERS, RequestAdapters
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.stats import StageStats

logger = logging.getLogger(__name__)


# Statistics calls of the stages, in parallel; a stuck one costs a thread, never a scrape's time.
_STATS_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="omni-stats")


def _stage_text(output: Any, stage_label: str) -> str:
    text = getattr(output, "outputs", None) and output.outputs[0].text
    if not text:
        raise StageEngineError(f"{stage_label} produced no text for the next stage to consume")
    return text


@dataclass
class _Run:
    """One request on its way through the stages: what its stage callbacks share.

    ``prompts`` / ``raw``: each stage's input and raw output so far, by stage id; ``current``:
    the stage request in flight (cancelled with ``done``); ``end``: one past its last stage.
    """

    request_id: str
    prompt: Any
    stage_params: Sequence[Any]
    adapters: dict[int, RequestAdapters]
    end: int
    on_output: Callable[[OmniRequestOutput], None] | None
    on_partial: Callable[[OmniRequestOutput], None] | None
    done: Future = field(default_factory=Future)
    finals: list[OmniRequestOutput] = field(default_factory=list)
    raw: dict[int, Any] = field(default_factory=dict)
    prompts: dict[int, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    current: list[Future] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompts[0] = self.prompt

    @property
    def entry_lora(self) -> Any:
        """The entry stage's adapter when it is an LLM stage's one adapter (input processors of later
        stages derive theirs from it: Qwen2.5-Omni's talker reads the thinker's), else ``None``."""
        entry = self.adapters.get(0, NO_ADAPTERS)
        return entry.lora_request if len(entry) == 1 else None


def _cancel_in_flight(done: Future, current: list[Future], lock: threading.Lock) -> None:
    """Done-callback of a request's future: when it was cancelled, cancel its stage request in flight."""
    if done.cancelled():
        with lock:
            in_flight = list(current)
        for stage_future in in_flight:
            stage_future.cancel()


class Orchestrator:
    """Owns one runtime per stage and chains requests through them.

    Every stage's model class is checked before the first engine is built, so a pipeline
    with a stage this installation cannot run fails at once.
    With ``worker_backend="mp"``, the workers of the stages on CPU share the host's cores by
    :func:`~vllm_omni.engine.cpu_threads.plan_pipeline_threads` (logged once at INFO).

    Raises:
        StageEngineError: a stage's model class is unavailable (nothing was started) or a
            stage failed to start (stages already started are shut down).
    """

    def __init__(self, config: VllmOmniConfig):
        self.config = config
        self.runtimes: list[StageRuntime] = []
        self._ids = itertools.count()
        self._closed = False
        self.connector: StageConnector = InProcessConnector("orchestrator")
        for stage in config.stages:
            check_stage_model_class(stage)
        threads = plan_pipeline_threads(config.stages, config.worker_backend)
        try:
            for stage in config.stages:
                logger.info("starting %s with model %s (%s)", stage.label, stage.model, config.worker_backend)
                self.runtimes.append(
                    make_stage_runtime(
                        stage,
                        config.worker_backend,
                        ray_address=config.ray_address,
                        config=config,
                        thread_envs=threads.get(stage.stage_id),
                    )
                )
            #: what every stage says it produces, takes and allows, in stage-id order
            self.descriptions: list[StageDescription] = [runtime.describe() for runtime in self.runtimes]
        except BaseException:
            self.shutdown()
            raise

    def submit(
        self,
        prompt: Any,
        stage_params: Sequence[Any],
        adapters: Mapping[int, RequestAdapters] | None = None,
        on_output: Callable[[OmniRequestOutput], None] | None = None,
        on_partial: Callable[[OmniRequestOutput], None] | None = None,
        last_stage: int | None = None,
    ) -> Future:
        """Run one request through every stage (through ``last_stage`` only, when given).

        Args:
            prompt: the entry stage's prompt (text, token ids or a vLLM prompt dict).
            stage_params: one sampling-params object per stage.
            adapters: ``{stage_id: RequestAdapters}``, the request's adapters per stage as the entry
                point built and checked them (:func:`vllm_omni.entrypoints.request_adapters.request_adapters`);
                a stage it does not name runs without adapters.
            on_output: called (from an engine thread) with each final-output stage's result.
            on_partial: streaming: see :meth:`_partial_hook`.
            last_stage: the request ends after this stage (e.g. text only from an audio pipeline:
                its later stages do not run); ``None``: the last stage.

        Returns:
            A future of the list of final-output :class:`OmniRequestOutput` in stage order.
            Cancelling it cancels the stage request in flight (an LLM stage aborts it in its
            engine at the next step) and starts no later stage.

        Raises (synchronously, nothing started): the entry stage's ``submit`` errors, and
        ``InvalidRequestError`` for an ``adapters`` key that is not a stage id.
        """
        self.check_open()
        adapters = dict(adapters or {})
        unknown = sorted(set(adapters) - set(range(len(self.runtimes))), key=repr)
        if unknown:
            raise InvalidRequestError(f"adapters name stages {unknown}, not stages of this pipeline")
        run = _Run(
            f"omni-{next(self._ids)}",
            prompt,
            stage_params,
            adapters,
            self._end(last_stage),
            on_output,
            on_partial,
        )
        first = self.runtimes[0].submit(self._stage_request(run, 0, prompt))
        run.current.append(first)
        run.done.add_done_callback(lambda f: _cancel_in_flight(f, run.current, run.lock))
        first.add_done_callback(lambda f: self._stage_done(run, 0, f))
        return run.done

    def _stage_request(self, run: _Run, stage_id: int, prompt: Any) -> StageRequest:
        """``run``'s request to stage ``stage_id``: its prompt, params, adapters and streaming hook."""
        return StageRequest(
            prompt,
            run.stage_params[stage_id],
            run.adapters.get(stage_id, NO_ADAPTERS),
            self._partial_hook(run, stage_id),
        )

    def _stage_done(self, run: _Run, stage_id: int, future: Future) -> None:
        """Done-callback of ``run``'s request in stage ``stage_id``: hand its output to the
        caller if final, then submit the next stage's input, or finish ``run.done``; any
        failure fails ``run.done``."""
        if run.done.cancelled():
            return
        try:
            result = future.result()
            stage = self.config.stages[stage_id]
            with run.lock:
                run.raw[stage_id] = result
            if stage.final_output:
                out = self._to_output(run.request_id, stage, run.prompts[stage_id], result, run.raw)
                run.finals.append(out)
                if run.on_output is not None:
                    run.on_output(out)
            nxt = stage_id + 1
            if nxt == run.end:
                run.done.set_result(run.finals)
                return
            run.prompts[nxt] = self._next_input(nxt, run.prompt, run.raw, run.stage_params, run.entry_lora)
            fut = self.runtimes[nxt].submit(self._stage_request(run, nxt, run.prompts[nxt]))
            with run.lock:
                run.current[:] = [fut]
            if run.done.cancelled():
                fut.cancel()
                return
            fut.add_done_callback(lambda f: self._stage_done(run, nxt, f))
        except BaseException as exc:  # propagate any stage failure to the caller
            if not run.done.done():
                run.done.set_exception(exc)

    def _end(self, last_stage: int | None) -> int:
        """One past the last stage a request runs (``last_stage`` of :meth:`submit`).

        Raises:
            InvalidRequestError: ``last_stage`` is not a stage id of this pipeline.
        """
        n = len(self.runtimes)
        if last_stage is None:
            return n
        if isinstance(last_stage, bool) or not isinstance(last_stage, int) or not 0 <= last_stage < n:
            raise InvalidRequestError(f"last_stage must be a stage id 0..{n - 1}, got {last_stage!r}")
        return last_stage + 1

    def _partial_hook(self, run: _Run, stage_id: int) -> Callable[[Any], None] | None:
        """The ``on_partial`` of ``run``'s request to stage ``stage_id`` (``None`` for most).

        A final-output LLM stage whose params ask for ``RequestOutputKind.DELTA`` gets one that
        hands ``run.on_partial`` (called from the engine thread) each step's piece as an
        :class:`OmniRequestOutput` whose ``request_output`` is that DELTA output; the stage's
        complete output still goes to ``on_output``.
        """
        stage = self.config.stages[stage_id]
        if run.on_partial is None or not (stage.is_llm and stage.final_output):
            return None
        if getattr(run.stage_params[stage_id], "output_kind", None) != RequestOutputKind.DELTA:
            return None
        on_partial = run.on_partial
        return lambda ro: on_partial(
            self._to_output(run.request_id, stage, run.prompts[stage_id], ro, run.raw)
        )

    def prepare_params(self, stage_params: Sequence[Any]) -> list[Any]:
        """``stage_params`` made ready once for many :meth:`submit` calls.

        Each runtime's ``prepare_params`` (LLM stages: one final output per request; identity
        for diffusion stages) converts its entry, so that submitting many requests with the
        result does not convert it again per request. Submitting unprepared params stays correct.
        """
        out = list(stage_params)
        for i, runtime in enumerate(self.runtimes[: len(out)]):
            out[i] = runtime.prepare_params(out[i])
        return out

    @contextlib.contextmanager
    def batching(self) -> Iterator[None]:
        """Requests submitted inside this block may share the entry stage's first batch.

        Uses the entry runtime's ``hold()``; a no-op once the pipeline is shut down.
        """
        with self.runtimes[0].hold() if self.runtimes else contextlib.nullcontext():
            yield

    def _next_input(
        self,
        stage_id: int,
        user_prompt: Any,
        raw: dict[int, Any],
        stage_params: Sequence[Any] = (),
        lora_request: Any = None,
    ) -> Any:
        spec = self.config.pipeline.stages[stage_id]
        stage = self.config.stages[stage_id]
        sources = stage.engine_input_source or [stage_id - 1]
        if spec.input_processor == "prompt":
            return user_prompt
        if spec.input_processor == "previous_text":
            src = self.config.stages[sources[0]]
            return _stage_text(raw[sources[0]], src.label)
        processor = input_processor(spec.input_processor)
        if processor is not None:  # tensors between stages: through the connector
            payload = processor(raw[sources[0]], list(stage_params), lora_request)
            return self.connector.receive(self.connector.send(payload))
        raise StageEngineError(
            f"{stage.label}: input processor {spec.input_processor!r} is not implemented in this build"
        )

    def _to_output(
        self, request_id: str, stage, prompt: Any, result: Any, raw: dict[int, Any]
    ) -> OmniRequestOutput:
        """``result`` of ``stage`` as the caller's output, by what the stage described it makes."""
        kind = self.descriptions[stage.stage_id].output_kind
        common = {"prompt": prompt, "stage_outputs": raw}
        if kind == "audio":
            return OmniRequestOutput(
                request_id,
                stage.stage_id,
                kind,
                audio=result.waveform,
                sample_rate=result.sample_rate,
                **common,
            )
        if kind == "text":
            return OmniRequestOutput(request_id, stage.stage_id, kind, request_output=result, **common)
        if kind in ("image", "video"):
            return OmniRequestOutput(
                request_id,
                stage.stage_id,
                kind,
                images=list(result.images),
                videos=[list(v) for v in result.videos],
                latents=result.latents,
                **common,
            )
        return OmniRequestOutput(request_id, stage.stage_id, kind, **common)  # codec tokens: in stage_outputs

    # ---------------------------------------------------------------- LoRA management
    def lora_call(self, method: LoRAMethod, *args: Any, stage_id: int | None = None) -> dict[int, Any]:
        """Call a LoRA management method on every stage that supports LoRA (or on ``stage_id`` only).

        An adapter fits one model: on a pipeline mixing LLM and diffusion stages, pass
        ``stage_id`` so that an adapter meant for one stage is not offered to the other.

        Returns:
            ``{stage_id: result}`` for the stages that implement it.

        Raises:
            ConfigError: no stage ``stage_id``.
            LoRANotEnabledError: no (selected) stage of the pipeline has LoRA enabled (message lists them).
        """
        self.check_open()
        results: dict[int, Any] = {}
        skipped: list[str] = []
        if stage_id is not None:
            self.config.stage_by_id(stage_id)
        for stage, runtime in zip(self.config.stages, self.runtimes):
            if stage_id is not None and stage.stage_id != stage_id:
                continue
            try:
                results[stage.stage_id] = getattr(runtime, method)(*args)
            except LoRANotEnabledError:
                skipped.append(stage.label)
        if skipped:
            logger.info("%s: skipped stages without LoRA: %s", method, ", ".join(skipped))
        if not results:
            raise LoRANotEnabledError(
                f"{method}: no stage of pipeline {self.config.pipeline.name!r} has LoRA enabled "
                f"({', '.join(skipped)}); enable it with enable_lora (LLM stages) or the diffusion LoRA options"
            )
        return results

    def stage_health(self) -> dict[int, str]:
        """``{stage_id: state}``, a state of ``supervisor.HEALTH_STATES`` (every stage ``"dead"`` once shut down).

        An ``mp`` / ``ray`` stage is ``"restarting"`` while its worker is being replaced and
        ``"dead"`` when its restarts are exhausted; an inline stage is ``"dead"`` after a fatal engine error.
        """
        if self._closed:
            return {stage.stage_id: "dead" for stage in self.config.stages}
        return {stage.stage_id: runtime.health() for stage, runtime in zip(self.config.stages, self.runtimes)}

    def attach_adapter_owner(
        self,
        expected: Callable[[int], list[tuple[Any, bool]]],
        on_restart: Callable[[int, dict[int, str], int], None],
    ) -> None:
        """Make the engine's adapter registry what restarted workers restore: ``expected(stage_id)``
        lists ``(LoRARequest, pinned)`` a stage must hold; ``on_restart(stage_id, failed, replica)``
        hears what a restart could not restore. Stages in this process never restart."""
        for stage, runtime in zip(self.config.stages, self.runtimes):
            attach = getattr(runtime, "attach_adapter_owner", None)  # inline runtimes never restart
            if attach is not None:
                attach(
                    functools.partial(expected, stage.stage_id), functools.partial(on_restart, stage.stage_id)
                )

    def stage_stats(self, timeout: float = 5.0) -> dict[int, StageStats | None]:
        """``{stage_id: snapshot}`` of every stage, asked in parallel (``stats()`` of each runtime).

        A stage that cannot answer within ``timeout`` seconds (its worker restarting, dead or
        stuck) maps to ``None``; this never raises for a stage's sake.
        """
        self.check_open()
        pairs = list(zip(self.config.stages, self.runtimes))
        futures = {stage.stage_id: _STATS_POOL.submit(runtime.stats) for stage, runtime in pairs}
        deadline = time.monotonic() + timeout
        out: dict[int, StageStats | None] = {}
        for stage_id, fut in futures.items():
            try:
                out[stage_id] = fut.result(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                logger.debug("stage %d: no statistics: %s", stage_id, exc)
                out[stage_id] = None
        return out

    def check_open(self) -> None:
        if self._closed:
            raise StageEngineError(
                f"pipeline {self.config.pipeline.name!r} is shut down; create a new engine"
            )

    def shutdown(self, timeout: float | None = None) -> None:
        """Shut every stage down; with ``timeout``, all of them within that many seconds in total.

        Stages in worker processes or actors (``mp``, ``ray``) stop at the same time, each on a
        thread of its own, so a pipeline stops in the time of its slowest stage, not their sum;
        stages in this process (``inline``) stop one after the other (vLLM's engine teardown
        releases process-wide state).
        """
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout

        def stop(runtime: StageRuntime) -> None:
            try:
                runtime.shutdown(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except Exception:  # best effort: keep shutting the others down
                logger.exception("error while shutting down a stage")

        runtimes, self.runtimes = self.runtimes, []
        if self.config.worker_backend == "inline" or len(runtimes) < 2:
            for runtime in runtimes:
                stop(runtime)
            return
        threads = [
            threading.Thread(target=stop, args=(runtime,), name=f"omni-stop-{i}", daemon=True)
            for i, runtime in enumerate(runtimes)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
