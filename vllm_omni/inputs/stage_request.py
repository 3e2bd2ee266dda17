"""The one argument of a stage runtime's ``submit``: :class:`StageRequest`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_omni.lora.request import NO_ADAPTERS, RequestAdapters


@dataclass(frozen=True)
class StageRequest:
    """One request to one stage, as every stage runtime takes it
    (:meth:`StageRuntime.submit <vllm_omni.engine.protocols.StageRuntime.submit>`).

    Attributes:
        prompt: what the stage's description says it takes (``inputs``): text, a vLLM prompt
            (token ids or a dict), a ``{"prompt", "negative_prompt", "image"}`` dict for a diffusion
            stage, or an earlier stage's ``StagePayload``.
        params: the stage's params type (``vllm.SamplingParams``, ``OmniDiffusionSamplingParams``,
            ``AudioParams``, ...); ``None`` takes the stage's default.
        adapters: the request's adapters on this stage, built and checked once by the entry point
            (:func:`vllm_omni.entrypoints.request_adapters.request_adapters`); a stage does not check
            the list rules again.
        on_partial: LLM stages, streaming: called with each engine step's DELTA output (on the
            stage's thread). It never crosses a process boundary: a worker proxy sends a flag and calls
            it on its side.
    """

    prompt: Any
    params: Any = None
    adapters: RequestAdapters = NO_ADAPTERS
    on_partial: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.adapters, RequestAdapters):
            raise TypeError(
                f"StageRequest.adapters must be RequestAdapters, got {type(self.adapters).__name__} "
                "(build it with RequestAdapters.of / RequestAdapters.composed)"
            )
