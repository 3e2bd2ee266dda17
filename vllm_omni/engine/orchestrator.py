"""Runs requests through the stages of a pipeline in order.

Each stage runtime exposes ``submit(prompt, params, lora_request=None) -> Future``. The
orchestrator submits a request to the entry stage with the caller's adapter, and, when
a stage finishes, builds the next stage's input from its sources' outputs (the
``input_processor`` of the stage spec) and submits it **without** the adapter: a
request's adapter reaches the entry stage only.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.engine.connectors import InProcessConnector, StageConnector
from vllm_omni.engine.cpu_threads import plan_pipeline_threads
from vllm_omni.engine.inline_runtime import check_stage_model_class
from vllm_omni.engine.protocols import LoRAMethod, StageRuntime
from vllm_omni.engine.stage_factory import make_stage_runtime
from vllm_omni.engine.stage_registry import input_processor
from vllm_omni.errors import (
    InvalidAdapterError,
    InvalidRequestError,
    LoRANotEnabledError,
    StageEngineError,
    restate,
)
from vllm_omni.lora.request import LoRARequest
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
        except BaseException:
            self.shutdown()
            raise

    def submit(
        self,
        prompt: Any,
        stage_params: Sequence[Any],
        lora_request: Any = None,
        on_output: Callable[[OmniRequestOutput], None] | None = None,
        on_partial: Callable[[OmniRequestOutput], None] | None = None,
        stage_loras: Mapping[int, LoRARequest] | None = None,
        last_stage: int | None = None,
        **entry_kwargs: Any,
    ) -> Future:
        """Run one request through every stage (through ``last_stage`` only, when given).

        Args:
            prompt: the entry stage's prompt (text, token ids or a vLLM prompt dict).
            stage_params: one sampling-params object per stage.
            lora_request: adapter for the entry stage only.
            on_output / on_partial: called from an engine thread with each final stage result / streamed piece.
            stage_loras: ``{stage_id: adapter}`` for later LLM stages (see :meth:`check_stage_loras`).
            last_stage: the stage the request ends after (later stages do not run); ``None``: the last.
            entry_kwargs: extra per-request arguments of the entry stage runtime, passed on unchanged
                (a diffusion entry stage's ``adapters``: :class:`~vllm_omni.lora.request.RequestAdapter` s).

        Returns:
            A future of the list of final-output :class:`OmniRequestOutput` in stage order; cancelling
            it cancels the stage request in flight (an LLM stage aborts it) and starts no later stage.

        Raises (synchronously, nothing started): errors of :meth:`check_stage_loras` and of the entry stage's ``submit``.
        """
        self.check_open()
        self.check_stage_loras(stage_loras := dict(stage_loras or {}))
        end = self._end(last_stage)
        request_id = f"omni-{next(self._ids)}"
        done: Future = Future()
        finals: list[OmniRequestOutput] = []
        raw: dict[int, Any] = {}
        prompts: dict[int, Any] = {0: prompt}
        lock = threading.Lock()
        current: list[Future] = []  # the stage request in flight

        def run_stage(stage_id: int, future: Future) -> None:
            if done.cancelled():
                return
            try:
                result = future.result()
                stage = self.config.stages[stage_id]
                with lock:
                    raw[stage_id] = result
                if stage.final_output:
                    out = self._to_output(request_id, stage, prompts[stage_id], result, raw)
                    finals.append(out)
                    if on_output is not None:
                        on_output(out)
                nxt = stage_id + 1
                if nxt == end:
                    done.set_result(finals)
                    return
                prompts[nxt] = self._next_input(nxt, prompt, raw, stage_params, lora_request)
                hook = self._partial_hook(request_id, nxt, stage_params[nxt], on_partial, prompts, raw)
                if nxt in stage_loras:
                    hook["lora_request"] = stage_loras[nxt]
                fut = self.runtimes[nxt].submit(prompts[nxt], stage_params[nxt], **hook)
                with lock:
                    current[:] = [fut]
                if done.cancelled():
                    fut.cancel()
                    return
                fut.add_done_callback(lambda f: run_stage(nxt, f))
            except BaseException as exc:  # propagate any stage failure to the caller
                if not done.done():
                    done.set_exception(exc)

        hook = self._partial_hook(request_id, 0, stage_params[0], on_partial, prompts, raw)
        first = self.runtimes[0].submit(
            prompt, stage_params[0], lora_request=lora_request, **entry_kwargs, **hook
        )
        current.append(first)
        done.add_done_callback(lambda f: _cancel_in_flight(f, current, lock))
        first.add_done_callback(lambda f: run_stage(0, f))
        return done

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

    def check_stage_loras(self, stage_loras: Mapping[int, LoRARequest]) -> None:
        """Check the adapters of a request's later stages before anything starts.

        Args:
            stage_loras: ``{stage_id: LoRARequest}``; every key a stage after the entry stage.

        Raises:
            InvalidRequestError: a key that is not a later stage of this pipeline, a diffusion
                stage, or a value that is not a ``LoRARequest``;
            LoRANotEnabledError: the named stage has no ``enable_lora`` (the message names the
                stage and the option);
            InvalidAdapterError: the adapter cannot be served by that stage.
        """
        n = len(self.runtimes)
        for stage_id, lora in stage_loras.items():
            if isinstance(stage_id, bool) or not isinstance(stage_id, int) or not 0 < stage_id < n:
                raise InvalidRequestError(
                    f"lora_request names stage {stage_id!r}, but pipeline {self.config.pipeline.name!r} "
                    f"has stages 0..{n - 1} (stage 0, the entry stage, takes the request's own adapter)"
                )
            stage = self.config.stages[stage_id]
            if not stage.is_llm:
                raise InvalidRequestError(
                    f"lora_request names {stage.label}: per-stage request adapters apply to LLM stages only"
                )
            if not isinstance(lora, LoRARequest):
                raise InvalidRequestError(
                    f"lora_request[{stage_id}] must be a LoRARequest, got {type(lora).__name__}: {lora!r:.200}"
                )
            try:
                self.runtimes[stage_id].validate_request(None, SamplingParams(), lora)
            except InvalidAdapterError as exc:  # name the entry and the stage it was meant for
                raise restate(exc, f"lora_request[{stage_id}] for {stage.label}") from exc

    def _partial_hook(
        self,
        request_id: str,
        stage_id: int,
        params: Any,
        on_partial: Callable[[OmniRequestOutput], None] | None,
        prompts: dict[int, Any],
        raw: dict[int, Any],
    ) -> dict[str, Any]:
        """Extra ``submit`` arguments of a stage for a streaming request (``{}`` for most).

        A final-output LLM stage whose params ask for ``RequestOutputKind.DELTA`` gets an
        ``on_partial`` that hands ``on_partial`` (called from the engine thread) each step's
        piece as an :class:`OmniRequestOutput` whose ``request_output`` is that DELTA output;
        the stage's complete output still goes to ``on_output``.
        """
        stage = self.config.stages[stage_id]
        if on_partial is None or not (stage.is_llm and stage.final_output):
            return {}
        if getattr(params, "output_kind", None) != RequestOutputKind.DELTA:
            return {}
        return {
            "on_partial": lambda ro: on_partial(
                self._to_output(request_id, stage, prompts[stage_id], ro, raw)
            )
        }

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

    @staticmethod
    def _to_output(
        request_id: str, stage, prompt: Any, result: Any, raw: dict[int, Any]
    ) -> OmniRequestOutput:
        if hasattr(result, "waveform"):  # an audio stage (e.g. Qwen2.5-Omni's code2wav)
            return OmniRequestOutput(
                request_id,
                stage.stage_id,
                "audio",
                prompt,
                audio=result.waveform,
                sample_rate=result.sample_rate,
                stage_outputs=raw,
            )
        if stage.is_llm:
            return OmniRequestOutput(
                request_id, stage.stage_id, "text", prompt, request_output=result, stage_outputs=raw
            )
        return OmniRequestOutput(
            request_id,
            stage.stage_id,
            "video" if result.videos else "image",
            prompt,
            images=list(result.images),
            videos=[list(v) for v in result.videos],
            latents=result.latents,
            stage_outputs=raw,
        )

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

    def failed_loras(self) -> dict[int, dict[int, str]]:
        """``{stage_id: {lora_int_id: error}}`` of the adapters a worker restart could not restore
        (stages with none are left out); requests naming one get its ``AdapterRestoreError``."""
        out = {}
        for stage, runtime in zip(self.config.stages, self.runtimes):
            failed = getattr(runtime, "failed_loras", dict)()  # inline runtimes never restart
            if failed:
                out[stage.stage_id] = failed
        return out

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
        """Shut every stage down; with ``timeout``, all of them within that many seconds in total."""
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        for runtime in self.runtimes:
            try:
                runtime.shutdown(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except Exception:  # best effort: keep shutting the others down
                logger.exception("error while shutting down a stage")
        self.runtimes = []
