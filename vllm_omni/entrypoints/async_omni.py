"""``AsyncOmni``: the asyncio entry point (used by the HTTP server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.sampling_params import RequestOutputKind

from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.entrypoints.request_adapters import without_params_loras
from vllm_omni.lora.request import LoRARequest, RequestAdapter, RequestAdapters
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.stats import StageStats

# Submitting validates the request's adapter (file reads) before anything is queued: never on
# the event loop. A few threads, so that one stuck file system call does not stop the others.
_SUBMIT_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="omni-submit")


def _cancel_submitted(submitted: Future) -> None:
    """Done-callback: cancel a request whose caller left while it was being submitted."""
    if not submitted.cancelled() and submitted.exception() is None:
        submitted.result().cancel()


async def _outputs(queue: asyncio.Queue, finished: asyncio.Future) -> AsyncIterator[OmniRequestOutput]:
    """What a request puts on ``queue`` until ``finished`` completes; then its failure, if any."""
    while True:
        getter = asyncio.ensure_future(queue.get())
        try:
            await asyncio.wait({getter, finished}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            yield getter.result()
            continue
        finished.result()  # raises the stage failure, if any
        while not queue.empty():
            yield queue.get_nowait()
        return


class AsyncOmni(OmniBase):
    """Serve a pipeline from asyncio code; many requests may be in flight at once.

    Construction starts the stage engines (blocking, as vLLM's ``AsyncLLM.from_engine_args``).
    See :class:`~vllm_omni.entrypoints.omni_base.OmniBase` for the arguments.
    """

    async def generate(
        self,
        prompt: Any,
        sampling_params: Any = None,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | dict[int, LoRARequest] | None = None,
        lora_scale: float | None = None,
        lora_requests: list[LoRARequest] | None = None,
        lora_scales: list[float] | None = None,
        adapters: Sequence[RequestAdapter] | None = None,
        adapters_field: str = "adapters",
        last_stage: int | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Run one prompt through the pipeline, yielding each final-output stage's result.

        ``lora_request`` is attached to the entry stage's request only; a dict
        ``{stage_id: LoRARequest}`` gives each named LLM stage its own adapter (per-stage request
        adapters, as ``Omni.generate``; refused before anything runs when a named stage is
        missing or has no LoRA enabled). For a diffusion entry
        stage ``lora_scale`` scales it, and ``lora_requests`` / ``lora_scales`` compose several
        adapters (scales default to 1.0 each); concurrent requests share denoiser batches.
        ``adapters`` gives them instead as :class:`~vllm_omni.lora.request.RequestAdapter`
        (``scale=None``: the stage default), the form the HTTP layer builds (``adapters_field`` names
        them in messages: ``"lora"`` for the HTTP field). ``last_stage``
        ends the request after that stage (later stages do not run; e.g. text only from
        ``qwen2_5_omni`` with ``last_stage=0``).

        Streaming: a final-output LLM stage whose ``SamplingParams.output_kind`` is
        ``RequestOutputKind.DELTA`` yields one output per engine step, as vLLM's ``AsyncLLM``
        does: ``request_output`` holds only that step's new tokens and text, and the last one
        has ``request_output.finished`` set. Other stages yield their complete output once.

        The request is submitted (adapter validation, file reads) on a worker thread, never on
        the event loop. Closing the generator or cancelling its task cancels the request in
        its stage (an LLM stage aborts it at the next step).

        Raises:
            ValueError: an invalid diffusion request (before anything runs);
            LoRANotEnabledError / InvalidAdapterError: before anything runs, when the adapter
            cannot be served by the entry stage; StageEngineError on a stage failure.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        params = self._stage_params(sampling_params)
        forms = dict(lora_request=lora_request, lora_scale=lora_scale, lora_requests=lora_requests)
        forms.update(lora_scales=lora_scales, adapters=adapters)
        [request_adapters] = self._request_adapters(1, params, adapters_field, **forms)
        params = [without_params_loras(p) for p in params]  # their adapters are in request_adapters now
        streamed = self._streamed_stages(params)

        def put(out: OmniRequestOutput) -> None:
            if request_id is not None:
                out.request_id = request_id
            loop.call_soon_threadsafe(queue.put_nowait, out)

        def on_output(out: OmniRequestOutput) -> None:
            if out.stage_id not in streamed:  # a streamed stage's pieces were its output
                put(out)

        done = await self._submit(
            prompt,
            params,
            request_adapters,
            on_output=on_output,
            on_partial=put if streamed else None,
            last_stage=last_stage,
        )
        finished = asyncio.wrap_future(done)
        try:
            async for out in _outputs(queue, finished):
                yield out
        finally:
            # the caller went away (task cancelled, e.g. an HTTP client disconnected, or the
            # generator closed early): stop the request in its stage instead of running it out
            if not done.done():
                done.cancel()

    def _streamed_stages(self, params: list[Any]) -> set[int]:
        """Ids of the final-output LLM stages whose params ask for ``RequestOutputKind.DELTA``."""
        return {
            s.stage_id
            for s, p in zip(self.config.stages, params)
            if s.is_llm and s.final_output and getattr(p, "output_kind", None) == RequestOutputKind.DELTA
        }

    def _submit_versioned(
        self, prompt: Any, params: list[Any], adapters: dict[int, RequestAdapters], **kwargs: Any
    ) -> Future:
        """The request's adapters in their per-version form (files are checked), then ``Orchestrator.submit``
        (a multimodal prompt that would reach a text-only talker is refused first)."""
        self._check_multimodal_reach(prompt, kwargs.get("last_stage"))
        return self._orchestrator.submit(prompt, params, self._versioned(adapters), **kwargs)

    async def _submit(self, *args: Any, **kwargs: Any) -> Future:
        """:meth:`_submit_versioned` on a worker thread; a caller cancelled meanwhile cancels the request."""
        submitted = _SUBMIT_POOL.submit(self._submit_versioned, *args, **kwargs)
        try:
            return await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:
            submitted.add_done_callback(_cancel_submitted)
            raise

    async def add_lora(
        self,
        lora_request: LoRARequest,
        stage_id: int | list[int] | None = None,
        *,
        reload: bool = False,
        denoiser: str | None = None,
        replace: bool = True,
    ) -> bool:
        """Register an adapter (on a worker thread); see ``Omni.add_lora``."""
        return await asyncio.to_thread(self._add_lora, lora_request, stage_id, reload, denoiser, replace)

    async def remove_lora(self, lora_int_id: int, stage_id: int | None = None) -> bool:
        """Remove an adapter; see ``Omni.remove_lora``."""
        return await asyncio.to_thread(self._remove_lora, lora_int_id, stage_id)

    async def remove_lora_named(self, lora_name: str) -> bool:
        """Unregister the adapter called ``lora_name`` from every stage; ``False`` when no adapter of that
        name is registered (of concurrent calls for one registration exactly one answers ``True``)."""
        return await asyncio.to_thread(self.adapter_registry.remove_name, lora_name) is not None

    async def list_loras(self, stage_id: int | None = None) -> set[int]:
        """Ids of the loaded adapters; see ``Omni.list_loras``."""
        return await asyncio.to_thread(self._list_loras, stage_id)

    async def pin_lora(self, lora_int_id: int, stage_id: int | None = None) -> bool:
        """Pin an adapter; see ``Omni.pin_lora``."""
        return await asyncio.to_thread(self._pin_lora, lora_int_id, stage_id)

    async def get_stage_stats(self, timeout: float = 5.0) -> dict[int, StageStats | None]:
        """:meth:`stage_stats` off the event loop (the HTTP ``/metrics`` route calls this)."""
        return await asyncio.to_thread(self.stage_stats, timeout)
