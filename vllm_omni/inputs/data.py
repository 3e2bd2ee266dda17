"""Typed request parameters for diffusion stages."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.request import RequestAdapter, to_request_adapters

OUTPUT_TYPES = ("pil", "latent", "np", "pt")
#: Upper bounds that keep one request from exhausting host memory (noise and prompt padding).
MAX_IMAGES_PER_PROMPT = 64
MAX_SEQUENCE_LENGTH = 4096


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class OmniDiffusionSamplingParams:
    """Per-request settings of a text-to-image diffusion stage.

    Attributes:
        height, width: output size in pixels; ``None`` takes the pipeline default
            (Z-Image: the VAE's ``sample_size``, 1024 for the released model). Must be positive and a multiple of the pipeline's spatial
            factor (16 for Z-Image / SD3-style 8x VAEs with 2x2 patches); the pipeline checks the factor.
        num_inference_steps: denoising steps, ``>= 1``.
        guidance_scale: classifier-free guidance weight, finite and ``>= 0``; ``None`` takes the
            pipeline default. For Z-Image CFG runs when it is ``> 0``.
        negative_prompt: text (or one text per prompt) for the unconditional branch.
        seed: seeds a fresh ``torch.Generator`` per prompt, so a prompt gets the same
            noise alone or in a batch. Ignored when ``generator`` is given.
        generator: explicit generator(s), diffusers semantics (one draws the whole batch).
        num_images_per_prompt: images per prompt, 1 to :data:`MAX_IMAGES_PER_PROMPT`.
        output_type: ``"pil"`` (PIL images), ``"latent"`` (no decode), ``"np"`` or ``"pt"``.
        max_sequence_length: caption token limit of the text encoder (prompts are padded to
            it), 1 to :data:`MAX_SEQUENCE_LENGTH`.
        lora_requests: ``vllm_omni.lora.request.LoRARequest`` objects to activate for
            this request (consumed by the diffusion LoRA manager).
        lora_scales: one scale per entry of ``lora_requests``; empty means 1.0 each (or the
            stage's ``lora_scale`` for an adapter the stage pre-loaded from ``lora_path``).
            ``0`` adds exactly nothing; a negative scale negates the adapter's delta. An entry may
            also be a schedule: a list with one value per denoising step, a list of step-fraction
            ranges ``{"start", "end", "scale"}``, ``{"steps": ..., "blocks": {pattern: multiplier}}``
            or a :class:`vllm_omni.lora.schedule.LoRAScaleSchedule` (see that module for the step
            and block conventions); :attr:`adapters` carries it parsed, as a ``LoRAScaleSchedule``.
        extra_args: pipeline-specific keyword arguments passed through unchanged.

    Raises:
        InvalidRequestError (a ValueError): (on construction) for a non-positive size or step count, negative or
            non-finite guidance, ``num_images_per_prompt`` or ``max_sequence_length`` out of
            range, a non-integer value, an unknown ``output_type``, mismatched
            LoRA list lengths, an adapter listed twice, a non-finite scale or a malformed schedule
            (e.g. a per-step list whose length is not ``num_inference_steps``); the message names
            the field and allowed values (the adapter rules are
            :func:`vllm_omni.lora.request.validate_request_adapters`; those raise
            ``InvalidRequestError``, a ``ValueError``).
    """

    height: int | None = None
    width: int | None = None
    num_inference_steps: int = 50
    guidance_scale: float | None = None
    negative_prompt: str | list[str] | None = None
    seed: int | None = None
    generator: torch.Generator | list[torch.Generator] | None = None
    num_images_per_prompt: int = 1
    output_type: str = "pil"
    max_sequence_length: int = 512
    lora_requests: list[Any] = field(default_factory=list)
    lora_scales: list[Any] = field(default_factory=list)
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value <= 0):
                raise InvalidRequestError(
                    f"{name} must be a positive integer (multiple of 16), got {value!r}"
                )
        if not _is_int(self.num_inference_steps) or self.num_inference_steps < 1:
            raise InvalidRequestError(
                f"num_inference_steps must be an integer >= 1, got {self.num_inference_steps!r}"
            )
        g = self.guidance_scale
        if g is not None and (
            isinstance(g, bool) or not isinstance(g, int | float) or not math.isfinite(g) or g < 0
        ):
            raise InvalidRequestError(
                f"guidance_scale must be >= 0 and finite (0 disables guidance), got {g!r}"
            )
        n = self.num_images_per_prompt
        if not _is_int(n) or not 1 <= n <= MAX_IMAGES_PER_PROMPT:
            raise InvalidRequestError(
                f"num_images_per_prompt must be an integer >= 1 and <= {MAX_IMAGES_PER_PROMPT}, got {n!r}"
            )
        if self.output_type not in OUTPUT_TYPES:
            raise InvalidRequestError(
                f"output_type must be one of {list(OUTPUT_TYPES)}, got {self.output_type!r}"
            )
        msl = self.max_sequence_length
        if not _is_int(msl) or not 1 <= msl <= MAX_SEQUENCE_LENGTH:
            # prompts are padded to this length: a huge value exhausts host memory
            raise InvalidRequestError(
                f"max_sequence_length must be an integer in [1, {MAX_SEQUENCE_LENGTH}], got {msl!r}"
            )
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        neg = self.negative_prompt
        if neg is not None and not (
            isinstance(neg, str) or (isinstance(neg, list | tuple) and all(isinstance(x, str) for x in neg))
        ):
            raise InvalidRequestError(
                f"negative_prompt must be a string or a list of strings, got {neg!r:.200}"
            )
        if not isinstance(self.extra_args, dict):
            raise InvalidRequestError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        to_request_adapters(self.lora_requests, self.lora_scales, num_steps=self.num_inference_steps)

    @property
    def adapters(self) -> tuple[RequestAdapter, ...]:
        """``lora_requests`` with their ``lora_scales`` (``scale=None`` where no scales were given)."""
        return to_request_adapters(self.lora_requests, self.lora_scales, num_steps=self.num_inference_steps)

    def make_generators(
        self, n_prompts: int, device: str | torch.device = "cpu"
    ) -> list[torch.Generator | None]:
        """One generator per prompt: seeded copies of ``seed`` (or a random seed when both it and
        ``generator`` are ``None``). With ``generator`` set this returns ``[]``; use it directly."""
        if self.generator is not None:
            return []
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        return [torch.Generator(device=device).manual_seed(seed) for _ in range(n_prompts)]
