"""The contract of a stage runtime: what the :class:`~vllm_omni.engine.orchestrator.Orchestrator`
and the entry points call on every stage, LLM or diffusion, and what a stage says about itself
(:class:`StageDescription`).

Both runtimes (:class:`~vllm_omni.engine.llm_stage.LLMStageEngine`,
:class:`~vllm_omni.engine.diffusion_stage.DiffusionStageEngine`) implement it on top of
:class:`~vllm_omni.engine.stage_driver.StageDriver`: every call is thread-safe and the
engine itself is only touched by the stage's driver thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from vllm_omni.config.stage_config import BaseVllmOmniStageConfig
    from vllm_omni.inputs.stage_request import StageRequest
    from vllm_omni.lora.request import LoRARequest
    from vllm_omni.stats import StageStats

#: The LoRA management calls the orchestrator fans out to stages (``Orchestrator.lora_call``).
LoRAMethod = Literal["add_lora", "remove_lora", "list_loras", "pin_lora"]

#: What a stage produces: ``"text"`` (a vLLM ``RequestOutput``), ``"image"`` / ``"video"`` (a
#: ``DiffusionOutput``), ``"audio"`` (a waveform), ``"codec"`` (codec tokens for a later stage).
OutputKind = Literal["text", "image", "video", "audio", "codec"]
#: What a stage's prompt may be: ``"text"``, ``"token_ids"`` (a vLLM prompt of ids), ``"image"``
#: (an input image beside the text: image-to-image), ``"stage_payload"`` (tensors an earlier stage
#: handed over, :class:`~vllm_omni.engine.connectors.StagePayload`), ``"media_payload"`` (such tensors
#: for an entry prompt with audio / image / video: the hand-off carries what the stage needs of those
#: positions, e.g. the thinker's hidden states).
InputKind = Literal["text", "token_ids", "image", "stage_payload", "media_payload"]


@dataclass(frozen=True)
class AdapterCapabilities:
    """What a stage does with LoRA adapters.

    Attributes:
        kind: ``"llm"`` (vLLM's LoRA: one adapter per request, at scale 1.0) or ``"diffusion"``
            (:class:`~vllm_omni.diffusion.lora.DiffusionLoRAManager`: composed adapters with scales).
        max_loras: adapters active at once (vLLM's ``max_loras``: per engine step; diffusion: per batch).
        max_per_request: adapters one request may carry (1 on LLM stages, ``max_loras`` on diffusion ones).
        max_lora_rank: the largest rank the stage takes (``None``: no fixed bound).
        denoisers: diffusion: the pipeline modules adapters bind to (``"transformer"``, ``"transformer_2"``).
        startup_adapters: the adapters the stage loaded and pinned at start (``lora_path``, PEFT backend).
    """

    kind: Literal["llm", "diffusion"]
    max_loras: int
    max_per_request: int
    max_lora_rank: int | None = None
    denoisers: tuple[str, ...] = ()
    startup_adapters: tuple[LoRARequest, ...] = ()


@dataclass(frozen=True)
class StageDescription:
    """What a running stage is, as it reports it (:meth:`StageRuntime.describe`); picklable, so a
    worker's description reaches the caller's process unchanged.

    Attributes:
        stage_id / label: the stage (its label names it in errors).
        output_kind: what it produces (:data:`OutputKind`).
        inputs: what its prompt may be (:data:`InputKind`).
        params_type: the per-request params it takes (``vllm.SamplingParams``,
            ``OmniDiffusionSamplingParams``, ``AudioParams``).
        max_model_len: LLM stages: the longest sequence (prompt + output, tokens) the engine holds.
        max_batch_size: diffusion stages: prompts per denoiser batch.
        max_image_size: diffusion stages: the largest ``(height, width)`` in pixels (``None``: none declared).
        size_multiple: diffusion stages: image sides must be multiples of it (pixels).
        voices: audio stages: the voices a request may choose.
        media_limits: LLM stages of a multimodal model: the most items of each input modality
            (``"audio"``, ``"image"``, ...) one prompt may carry, as vLLM resolved them (the model's
            support and ``limit_mm_per_prompt``); empty for a text-only model.
        audio_sample_rate: LLM stages taking audio: the rate (Hz) of its feature extractor.
        adapters: what it does with LoRA adapters, ``None`` when LoRA is not enabled.
        image_optional: a stage whose ``inputs`` hold ``"image"`` also takes requests without one (Wan2.2
            TI2V-5B: text-to-video, image-to-video with one); ``False``: such a stage needs the image.
    """

    stage_id: int
    label: str
    output_kind: OutputKind
    inputs: frozenset[InputKind]
    params_type: type
    max_model_len: int | None = None
    max_batch_size: int | None = None
    max_image_size: tuple[int, int] | None = None
    size_multiple: int | None = None
    voices: tuple[str, ...] = ()
    adapters: AdapterCapabilities | None = None
    media_limits: Mapping[str, int] = field(default_factory=dict)
    audio_sample_rate: int | None = None
    image_optional: bool = False


@runtime_checkable
class StageRuntime(Protocol):
    """One running stage of a pipeline.

    Attributes:
        stage: the resolved config of the stage (its ``label`` names it in errors).
    """

    stage: BaseVllmOmniStageConfig

    def submit(self, request: StageRequest) -> Future:
        """Queue one request; the future resolves to the stage's output (a vLLM ``RequestOutput``,
        a ``DiffusionOutput``, ...). ``request.adapters`` was built and checked against this
        stage's :meth:`describe` by the entry point; the stage applies them (an LLM stage also
        runs its adapter gate on the files). ``request.on_partial``: LLM stages stream each
        step's DELTA output to it.

        Raises (synchronously): ``OmniUserError`` subclasses for a bad request,
        ``StageEngineError`` when the stage is shut down or dead.
        """
        ...

    def validate_request(self, request: StageRequest) -> None:
        """Every check of :meth:`submit`, queueing nothing (same request, same errors)."""
        ...

    def prepare_params(self, params: Any) -> Any:
        """``params`` made ready once for many :meth:`submit` calls (identity when nothing to do)."""
        ...

    def hold(self) -> AbstractContextManager[None]:
        """Requests submitted inside the block start together when it exits."""
        ...

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter; ``True`` if newly loaded. ``LoRANotEnabledError`` without LoRA."""
        ...

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter; ``False`` if it was not loaded."""
        ...

    def list_loras(self) -> set[int]:
        """Ids of the loaded adapters."""
        ...

    def pin_lora(self, lora_int_id: int) -> bool:
        """Never evict this loaded adapter."""
        ...

    def stats(self) -> StageStats:
        """A snapshot of the stage's statistics (plain data; see :mod:`vllm_omni.stats`), without
        waiting for a running step or batch."""
        ...

    def health(self) -> str:
        """``"starting"``, ``"ready"``, ``"restarting"`` (its worker died and is being replaced) or
        ``"dead"`` (the vocabulary of ``vllm_omni.engine.workers.supervisor.HEALTH_STATES``)."""
        ...

    def describe(self) -> StageDescription:
        """What the running stage produces, takes and allows (a proxy asks its worker)."""
        ...

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the stage (idempotent); queued requests fail with ``StageEngineError``.

        ``timeout``: seconds the whole shutdown may take (requests still running are then
        abandoned and the stage's processes killed); ``None``: the runtime's own bound.
        """
        ...
