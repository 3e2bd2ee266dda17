"""The contract every diffusion pipeline (in-tree or the diffusers fallback) fulfils.

:class:`~vllm_omni.diffusion.worker.DiffusionWorker` drives a pipeline only through this
Protocol: it patches ``transformer`` (and ``transformer_2`` when present) with LoRA layers,
checks sizes against ``vae_scale_factor``, batches requests with different adapter sets
together only when ``mixed_lora_batch`` is true, and calls ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from vllm_omni.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams


def check_image_side(name: str, value: int | None, factor: int, limit: int | None = None) -> None:
    """Refuse an image side (``name``: ``"height"`` / ``"width"``, pixels; ``None``: unset, the default).

    Raises:
        InvalidRequestError: ``value`` is not a multiple of ``factor`` or exceeds ``limit``; its ``param``
            attribute is ``name`` (the HTTP layer names that field).
    """
    if value is None:
        return
    problem = None
    if value % factor:
        problem = f"{name} must be a multiple of {factor} for this model, got {value}"
    elif limit is not None and value > limit:
        problem = f"{name} {value} exceeds this model's maximum of {limit} pixels (the reach of its positional tables)"
    if problem is not None:
        exc = InvalidRequestError(problem)
        exc.param = name
        raise exc


#: ``lora_context(rows)`` is entered around the denoiser call(s): ``rows`` maps each denoiser
#: sample to its prompt index (CFG copies included), or ``None`` when every sample shares one
#: adapter set (pipelines with ``mixed_lora_batch = False``). A pipeline that takes a call-wide LoRA
#: scale (the diffusers fallback's ``joint_attention_kwargs={"scale": s}`` and its kin) passes it as
#: ``lora_context(rows, lora_scale=s)``: every adapter's scale is multiplied by ``s``. Around prompt
#: encoding a pipeline enters ``lora_context(rows, component="text_encoder")`` with the prompt index of
#: every encoded text (negative texts included; ``None``: one set for the call): the adapters'
#: text-encoder parts act on its text encoders (``pipelines.denoise.encode_texts`` does it for the
#: in-tree pipelines).
LoRAContextFactory = Callable[..., AbstractContextManager]


@runtime_checkable
class DiffusionPipeline(Protocol):
    """A text-to-image / text-to-video pipeline owned by one worker rank.

    Attributes:
        mixed_lora_batch: whether prompts with different adapter sets may share one call of
            :meth:`generate` (the pipeline reports each denoiser sample's prompt to ``lora_context``).
        transformer: the denoiser module LoRA patches (``None`` if the pipeline has none).
        vae_scale_factor: spatial VAE compression; image sizes must be multiples of twice it.

    Optionally a pipeline declares ``reports_denoising_step = True`` when its denoising loop wraps each
    denoiser call in :func:`vllm_omni.diffusion.forward_context.denoising_step` (per-step LoRA scale
    schedules need it; they are refused otherwise). Optionally a pipeline declares ``max_image_size``
    (largest ``(height, width)`` in pixels); the stage then refuses larger requests before they join
    a batch. Optionally it declares ``output_kind`` (``"image"``, the default, or ``"video"``) and
    ``accepts_image`` (whether a request may carry an input image; default ``False``); the stage
    reports both in its description (``StageRuntime.describe``).
    """

    mixed_lora_batch: ClassVar[bool]

    @property
    def transformer(self) -> torch.nn.Module | None: ...

    @property
    def vae_scale_factor(self) -> int: ...

    def generate(
        self,
        prompts: list[str],
        sp: OmniDiffusionSamplingParams,
        *,
        seeds: list[int | None] | None = None,
        lora_context: LoRAContextFactory | None = None,
    ) -> list[DiffusionOutput]:
        """One :class:`DiffusionOutput` per prompt, in order.

        Args:
            prompts: the texts of one batch.
            sp: the settings the prompts share (``negative_prompt`` may hold one entry per prompt).
            seeds: per-prompt seeds overriding ``sp.seed`` (``None`` entries keep it).
            lora_context: see :data:`LoRAContextFactory`.

        Raises:
            InvalidRequestError: sizes that are not multiples of ``2 * vae_scale_factor``, or an
                argument the pipeline does not take.
        """
        ...


def resolve_image_size(
    sp: OmniDiffusionSamplingParams,
    default: tuple[int, int],
    factor: int,
    limit: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """``(height, width)`` of a request: its own sides, else ``default``; each checked by :func:`check_image_side`.

    Raises:
        InvalidRequestError: a side that is not a multiple of ``factor`` or exceeds ``limit``.
    """
    height, width = sp.height or default[0], sp.width or default[1]
    for name, value, bound in zip(("height", "width"), (height, width), limit or (None, None)):
        check_image_side(name, value, factor, bound)
    return height, width
