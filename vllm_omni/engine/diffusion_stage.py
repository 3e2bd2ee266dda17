"""A diffusion stage: one :class:`~vllm_omni.diffusion.engine.DiffusionEngine` driven by one thread.

Same contract as the LLM stage runtime (``submit -> Future``, LoRA management, ``shutdown``):
all engine calls happen on the driver thread, so ``Omni`` and ``AsyncOmni`` share a runtime.

Batching. The driver takes the oldest queued request and joins to it the queued requests
whose sampling parameters are compatible (same size, steps, guidance, images per prompt,
output type, sequence length and extra arguments; an explicit ``generator`` is never
shared), up to ``max_batch_size`` prompts and ``max_loras`` distinct adapters in the batch.
The batch runs as one denoiser batch in which every prompt keeps its own adapter set and
scales (per-sample scale matrix of the LoRA manager). Pipelines that cannot report their
batch layout (the diffusers fallback) only batch requests with the same adapter set.
``hold()`` keeps the driver from starting a batch while several requests are submitted,
which is how ``Omni.generate`` batches a list of prompts deterministically.

A request is checked against the model's own limits (size multiple, largest size) when it is
submitted, before it can join a batch; should a batch call still fail, each member is run
alone, so no request fails for another's sake.

LoRA management (``add_lora`` / ``remove_lora`` / ``list_loras`` / ``pin_lora``) runs on the
driver thread between batches and reaches every tensor-parallel worker; ``remove_lora`` of
an adapter used by the running batch therefore waits for that batch to finish.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.config.diffusion import IN_TREE_PIPELINES, is_known_pipeline_class
from vllm_omni.config.stage_config import DiffusionStageConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.pipelines.base import check_image_side
from vllm_omni.diffusion.step_batching import step_supported
from vllm_omni.diffusion.worker_lora import startup_lora_request
from vllm_omni.engine.diffusion_steps import StepScheduling
from vllm_omni.engine.protocols import AdapterCapabilities, InputKind, StageDescription
from vllm_omni.engine.stage_driver import StageDriver
from vllm_omni.errors import (
    ConfigError,
    InvalidRequestError,
    OmniUserError,
    StageDeadError,
    StageEngineError,
    restate,
)
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest, RequestAdapters, lora_request_problem

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    prompt: str
    params: OmniDiffusionSamplingParams
    adapters: RequestAdapters
    seed: int | None
    future: Future
    submitted: float = field(default_factory=time.monotonic)


def _batch_key(item: _Pending, mixed_lora: bool) -> tuple:
    sp = item.params
    if sp.generator is not None:
        return ("generator", id(item))
    key: tuple = (
        sp.height,
        sp.width,
        sp.num_inference_steps,
        sp.guidance_scale,
        sp.num_images_per_prompt,
        sp.output_type,
        sp.max_sequence_length,
        repr(sorted(sp.extra_args.items())),
    )
    if not mixed_lora:
        key += (
            tuple((a.lora.lora_int_id, a.scale, a.denoiser, a.text_encoder_scale) for a in item.adapters),
        )
    return key


def _shared_negative(items: list[_Pending]) -> str | list[str] | None:
    negs = []
    for item in items:
        neg = item.params.negative_prompt
        negs.append(neg[0] if isinstance(neg, list | tuple) else neg)
    if len(set(negs)) == 1:
        return negs[0]
    return ["" if n is None else n for n in negs]


def check_pipeline_class(stage: DiffusionStageConfig) -> None:
    """Fail early when the stage's ``model_arch`` has neither an in-tree nor a diffusers pipeline.

    A stage without ``model_arch`` (its class comes from the model directory) passes here;
    its directory is checked when the engine starts.

    Raises:
        StageEngineError: naming the stage and the missing class.
    """
    if stage.model_arch and not is_known_pipeline_class(stage.model_arch):
        raise StageEngineError(
            f"{stage.label}: unknown pipeline class {stage.model_arch!r}: neither an in-tree pipeline "
            f"{sorted(IN_TREE_PIPELINES)} nor a class of the installed diffusers; choose a pipeline whose "
            f"stages use available classes"
        )


class DiffusionStageEngine(StepScheduling, StageDriver):
    """Runs one diffusion stage (in this process for TP=1, spawned ranks for TP>1).

    Args:
        stage: the resolved stage config; its ``diffusion_config`` (options already checked)
            is bound to ``stage.model``. Besides the engine settings it holds ``seed`` (default
            seed of requests without one) and ``max_batch_size`` (prompts per denoiser batch).

    Raises:
        StageEngineError: no model, an unusable model directory (naming the stage) or the
            engine failed to start.
        OmniUserError: a user error found while the engine starts (e.g. a ``lora_path`` file that
            fits no denoiser) keeps its class (``ConfigError``, ``LoRAFormatError``, ...); its
            message gains the stage label.
    """

    def __init__(self, stage: DiffusionStageConfig):
        self.stage = stage
        check_pipeline_class(stage)
        if not stage.model:
            raise StageEngineError(f"{stage.label}: no model directory given for the diffusion stage")
        try:
            self.od_config = stage.diffusion_config.with_model(stage.model)
        except ConfigError as exc:
            raise StageEngineError(f"{stage.label}: invalid diffusion option(s): {exc}") from exc
        self.default_seed = self.od_config.seed
        self.max_batch_size = self.od_config.max_batch_size
        self.max_loras = self.od_config.max_loras
        try:
            self._engine = DiffusionEngine(self.od_config)
            info = self._engine.collective_rpc("describe")[0]
        except OmniUserError as exc:  # e.g. a lora_path file: still the user's input to fix
            raise restate(exc, f"{stage.label}: diffusion engine failed to start") from exc
        except Exception as exc:
            raise StageEngineError(f"{stage.label}: diffusion engine failed to start: {exc}") from exc
        self.size_factor = int(info["size_factor"])
        #: the largest (height, width) the pipeline can make (None: not declared).
        self.max_size: tuple[int, int] | None = tuple(info["max_size"]) if info.get("max_size") else None
        self.mixed_lora_batch = bool(info["mixed_lora_batch"])
        self.startup_lora_ids: list[int] = list(info["startup_loras"])
        self._description = self._describe(info)
        #: sizes of the denoiser batches run so far, in prompts (observability / tests).
        self.batch_sizes: list[int] = []
        self._init_driver()
        self._init_steps()
        #: ``"step"`` or ``"request"``: how this stage batches (``batching="step"`` on a pipeline without
        #: a per-step unit, e.g. the diffusers fallback, batches whole requests)
        self.batching = self._batching_mode(info)
        self._take_worker_stats()  # the start-up adapters, loaded and pinned
        warm = info.get("warm_up")
        logger.info(
            "%s: diffusion stage ready (%s, %s)%s",
            stage.label,
            info["pipeline"],
            "compiled" if self.od_config.compiles else "eager",
            f"; compiled graphs warmed up at start: {warm[0]} in {warm[1]:.1f} s" if warm else "",
        )
        loop = self._drive_steps if self.batching == "step" else self._drive
        self._thread = threading.Thread(target=loop, name=f"omni-stage-{stage.stage_id}", daemon=True)
        self._thread.start()

    def _batching_mode(self, info: dict[str, Any]) -> str:
        if self.od_config.batching != "step":
            return "request"
        if self._engine.collective_rpc(step_supported)[0]:
            return "step"
        logger.warning(
            "%s: batching='step' is not available for %s (no per-step unit); whole requests are batched",
            self.stage.label,
            info["pipeline"],
        )
        return "request"

    def _describe(self, info: dict[str, Any]) -> StageDescription:
        """This stage's description from its pipeline's (rank 0's ``describe``)."""
        inputs: set[InputKind] = {"text", "image"} if info["accepts_image"] else {"text"}
        peft = self.od_config.lora_backend == "peft"  # the requests the worker pre-loaded and pinned
        startup = tuple(startup_lora_request(p) for p in self.od_config.startup_lora_paths) if peft else ()
        return StageDescription(
            self.stage.stage_id,
            self.stage.label,
            "video" if info["output_kind"] == "video" else "image",
            frozenset(inputs),
            OmniDiffusionSamplingParams,
            image_optional=bool(info["accepts_image"] and info.get("image_optional")),
            max_batch_size=self.max_batch_size,
            max_image_size=self.max_size,
            size_multiple=self.size_factor,
            adapters=AdapterCapabilities(
                "diffusion",
                self.od_config.max_loras,
                self.od_config.max_loras,
                self.od_config.max_lora_rank,
                denoisers=tuple(info["denoisers"]),
                startup_adapters=startup,
            ),
        )

    # ---------------------------------------------------------------- public API
    def describe(self) -> StageDescription:
        """Images or video out (as the pipeline declares); text in, and an input image when the
        pipeline takes one; batch and size limits; composed adapters up to ``max_loras``."""
        return self._description

    def submit(self, request: StageRequest) -> Future:
        """Queue one prompt; the future resolves to its :class:`~vllm_omni.diffusion.data.DiffusionOutput`.

        Args:
            request: ``prompt`` is text, or a dict with ``"prompt"`` (and optionally
                ``"negative_prompt"``); ``params`` the sampling settings (default
                ``OmniDiffusionSamplingParams()``); ``adapters`` the composed adapters, as the entry
                point built and checked them (``params.lora_requests`` must then be empty: the entry
                point moved them into ``adapters``).

        Raises (synchronously, before any work):
            InvalidRequestError: a bad prompt, size not a multiple of the model's factor or above its
                maximum (``max_size``), adapters also in ``params.lora_requests``, or an adapter path
                that does not exist.
            StageEngineError: the stage is shut down or failed earlier.
        """
        item = self._prepare(request)
        with self._cv:
            self._raise_if_unusable()
            self._queue.append(item)
            self._cv.notify()
        return item.future

    def validate_request(self, request: StageRequest) -> None:
        """Run every check of :meth:`submit` without queueing anything (same request, same errors)."""
        self._prepare(request)

    def _prepare(self, request: StageRequest) -> _Pending:
        prompt, params = request.prompt, request.params
        params = params if params is not None else OmniDiffusionSamplingParams()
        if not isinstance(params, OmniDiffusionSamplingParams):
            raise InvalidRequestError(
                f"{self.stage.label} takes OmniDiffusionSamplingParams, got {type(params).__name__}"
            )
        if isinstance(prompt, dict):
            if "negative_prompt" in prompt:
                params = dataclasses.replace(params, negative_prompt=prompt["negative_prompt"])
            prompt = prompt.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequestError(
                f"{self.stage.label}: prompt must be a string, got {type(prompt).__name__}"
            )
        neg = params.negative_prompt
        if isinstance(neg, list | tuple) and len(neg) != 1:
            raise InvalidRequestError(f"negative_prompt has {len(neg)} entries for 1 prompt")
        self._check_size(params)
        adapters = self._request_adapters(params, request.adapters)
        seed = params.seed if params.seed is not None else self.default_seed
        if seed is None and params.generator is None:
            seed = random.randrange(2**31 - 1)
        return _Pending(prompt, params, adapters, seed, Future())

    def _check_size(self, params: OmniDiffusionSamplingParams) -> None:
        """Refuse a size the model cannot make before it joins a batch (unset: the pipeline's default)."""
        limits = self.max_size or (None, None)
        for name, limit in zip(("height", "width"), limits):
            check_image_side(name, getattr(params, name), self.size_factor, limit)

    def _request_adapters(
        self, params: OmniDiffusionSamplingParams, adapters: RequestAdapters
    ) -> RequestAdapters:
        """The request's adapters, their files present (the list rules were checked by the entry point).

        Raises:
            InvalidRequestError: adapters in ``params.lora_requests`` too, or an adapter path that does not exist.
        """
        if params.lora_requests:
            raise InvalidRequestError(
                f"{self.stage.label}: OmniDiffusionSamplingParams.lora_requests reach a stage only through "
                "the entry point, which moves them into the request's adapters (Omni.generate / "
                "AsyncOmni.generate); give them there"
            )
        for adapter in adapters:
            lora = adapter.lora
            path = str(lora.lora_path)
            if "://" not in path and not os.path.exists(path):
                raise InvalidRequestError(
                    f"LoRA {lora.lora_int_id} ({lora.lora_name!r}): no such path {path!r}"
                )
        return adapters

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into every worker's host cache; ``True`` if it was newly loaded.

        Raises:
            ValueError: bad request / missing path; LoRAFormatError / LoRACacheError from the
                workers (their caches are unchanged).
        """
        problem = lora_request_problem(lora_request)
        if problem is not None:
            raise InvalidRequestError(f"add_lora: the adapter {problem}")
        return self._call_all_ranks("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Remove an adapter everywhere (waits for a running batch); ``False`` if not cached."""
        return self._call_all_ranks("remove_lora", lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters cached on this stage."""
        return set(self._call_all_ranks("list_loras"))

    def pin_lora(self, lora_int_id: int) -> bool:
        """Pin a cached adapter on every worker (``ValueError`` when it is not cached)."""
        return self._call_all_ranks("pin_lora", lora_int_id)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Run a worker method on every rank (on the driver thread, between batches)."""
        return self._call(lambda: self._engine.collective_rpc(method, *args))

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the driver and the workers; queued requests fail with ``StageEngineError``.

        ``timeout`` bounds the wait for a running batch plus the workers' exit (default: 60 s
        for the batch, then the engine's own bound); past it, tensor-parallel ranks are killed
        (their batch fails with ``StageDeadError``) and an in-process batch is abandoned.
        """
        deadline = time.monotonic() + (60.0 if timeout is None else timeout)
        if not self._stop_driver(self._thread, deadline - time.monotonic(), self._running_items()):
            return
        self._engine.shutdown(None if timeout is None else max(0.0, deadline - time.monotonic()))

    # ---------------------------------------------------------------- internals
    def _call_all_ranks(self, method: str, *args: Any) -> Any:
        results = self.collective_rpc(method, *args)
        first = results[0]
        if any(r != first for r in results[1:]):
            raise StageEngineError(
                f"{self.stage.label}: tensor-parallel workers disagree on {method}{args}: {results}"
            )
        return first

    def _take_batch(self) -> list[_Pending]:
        while self._queue and not self._queue[0].future.set_running_or_notify_cancel():
            self._queue.popleft()
        if not self._queue:
            return []
        first = self._queue.popleft()
        key = _batch_key(first, self.mixed_lora_batch)
        batch = [first]
        ids = {a.lora.lora_int_id for a in first.adapters}
        rest: collections.deque[_Pending] = collections.deque()
        while self._queue:
            item = self._queue.popleft()
            union = ids | {a.lora.lora_int_id for a in item.adapters}
            if (
                len(batch) < self.max_batch_size
                and len(union) <= self.max_loras
                and _batch_key(item, self.mixed_lora_batch) == key
            ):
                if not item.future.set_running_or_notify_cancel():
                    continue
                batch.append(item)
                ids = union
            else:
                rest.append(item)
        self._queue = rest
        return batch

    def _run_batch(self, batch: list[_Pending]) -> None:
        """Run ``batch`` and resolve its futures. When the batch call itself fails, each member
        is run alone, so a request fails only for its own sake (a dead stage fails them all)."""
        started = time.monotonic()
        try:
            results = self._generate(batch)
        except Exception as exc:
            logger.warning("%s: batch of %d failed: %s", self.stage.label, len(batch), exc)
            if isinstance(exc, StageDeadError):
                with self._cv:
                    self._dead = exc
            if len(batch) == 1 or isinstance(exc, StageDeadError):
                for item in batch:
                    self._record(item, started, exc)
                    item.future.set_exception(exc)
                return
            for item in batch:
                self._run_batch([item])
            return
        finally:
            self._take_worker_stats()
        for item, res in zip(batch, results, strict=True):
            self._record(item, started, res)
            if isinstance(res, BaseException):
                item.future.set_exception(res)
            else:
                item.future.set_result(res)

    def _record(self, item: _Pending, started: float, result: Any) -> None:
        """Note a finished request in the stage's statistics."""
        ok = not isinstance(result, BaseException)
        self.recorder.request_done(
            [a.lora.lora_name or str(a.lora.lora_int_id) for a in item.adapters],
            time.monotonic() - item.submitted,
            ok,
            queued=started - item.submitted,
            images=len(getattr(result, "images", None) or []) if ok else 0,
            videos=len(getattr(result, "videos", None) or []) if ok else 0,
        )

    def _take_worker_stats(self) -> None:
        """Move rank 0's statistics events (adapter loads, slots, steps) into the recorder (driver thread)."""
        if self._dead is not None or self._closed:
            return
        try:
            self.recorder.apply(self._engine.collective_rpc("stats_events")[0])
        except Exception as exc:  # statistics never fail a request
            logger.debug("%s: statistics not collected: %s", self.stage.label, exc)

    def _generate(self, batch: list[_Pending]) -> list[Any]:
        """One denoiser batch on every rank: rank 0's per-request outputs or exceptions."""
        first = batch[0].params
        sp = dataclasses.replace(
            first, seed=None, negative_prompt=_shared_negative(batch), lora_requests=[], lora_scales=[]
        )
        self.batch_sizes.append(len(batch))
        return self._engine.collective_rpc(
            "generate_batch",
            [item.prompt for item in batch],
            sp,
            [item.adapters for item in batch],
            [item.seed for item in batch],
        )[0]

    def _drive(self) -> None:
        while (work := self._next_work(self._take_batch)) is not None:
            commands, batch = work
            self._run_commands(commands)
            if commands:
                self._take_worker_stats()
            if batch:
                self._run_batch(batch)
