"""Steps every in-tree diffusion pipeline shares (Z-Image, Qwen-Image, Wan): one home for each.

A pipeline adds its own prompt encoding, latent layout, denoiser call and decoding; these functions
do the rest, in the order a ``generate`` uses them::

    embeds = encode_texts(encode, prompts, sp.negative_prompt, cfg, lora_context)  # prompts (+ negatives)
    latents = seeded_noise(shape, n, sp, len(prompts), seeds, device)          # (P*n, *shape) fp32
    adapters = lora_scope(lora_context, denoiser_rows(len(prompts), n, cfg))  # LoRA row layout
    scheduler = prepare_scheduler(pipe.scheduler, device, sigmas=..., mu=...)
    latents = run_denoising_loop(scheduler, latents, predict, adapters, progress_bar=...)
    results = split_by_prompt(prompts, latents, n); attach_decoded(results, images, output_type, n)

The CFG layout is fixed: the denoiser batch holds the ``P * n`` positive samples (``n`` per prompt,
prompt order) and then, with CFG, the same ``P * n`` samples again for the negative branch;
:func:`denoiser_rows` reports exactly that layout to the LoRA worker (``lora_context(rows)``), so a
batch may mix prompts with different adapter sets. ``predict`` is the pipeline's own step: it runs
the denoiser on that batch and combines the CFG branches (each model has its own formula).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.forward_context import denoising_step, set_forward_context
from vllm_omni.diffusion.progress import step_progress
from vllm_omni.errors import InvalidRequestError

if TYPE_CHECKING:
    from vllm_omni.diffusion.pipelines.base import LoRAContextFactory
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

#: ``predict(step_index, timestep, latents) -> velocity`` handed to ``scheduler.step``.
Predict = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class InTreePipelineBase:
    """What the in-tree pipelines declare and load alike (subclass it; see ``pipelines.base.DiffusionPipeline``).

    Class attributes: requests with different adapter sets share one denoiser batch
    (``mixed_lora_batch``: the pipeline reports each sample's prompt, CFG copies included), the loop
    declares every step (``reports_denoising_step``: per-step LoRA schedules work), images out and no
    input image (override ``output_kind`` / ``accepts_image`` otherwise).
    """

    mixed_lora_batch = True
    reports_denoising_step = True
    output_kind = "image"
    accepts_image = False

    def _load_text_and_scheduler(self, od_config, device: str | torch.device | None) -> Path:
        """Set ``od_config``, ``device``, ``dtype`` and load ``tokenizer`` (``AutoTokenizer``),
        ``text_encoder`` (the ``model_index.json`` class, in ``dtype``, eval, no gradients) and
        ``scheduler`` from the model folder; returns that folder."""
        from transformers import AutoTokenizer

        root = Path(od_config.model)
        comps = od_config.components
        self.od_config = od_config
        self.device = torch.device(device or od_config.resolved_device())
        self.dtype = od_config.torch_dtype()
        self.tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
        self.text_encoder = load_component(root, "text_encoder", comps["text_encoder"], dtype=self.dtype)
        self.text_encoder.to(self.device).eval().requires_grad_(False)
        self.scheduler = load_component(root, "scheduler", comps["scheduler"])
        return root


def load_component(root: str | Path, name: str, spec: tuple[str, str] | list[str], **kwargs: Any):
    """``<library>.<Class>.from_pretrained(root / name, **kwargs)`` for a ``model_index.json`` entry
    ``spec = (library, class name)`` (e.g. ``("transformers", "Qwen3Model")``)."""
    library, cls_name = spec
    cls = getattr(importlib.import_module(library), cls_name)
    return cls.from_pretrained(str(Path(root) / name), **kwargs)


def negative_texts(prompts: list[str], negative: str | list[str] | None) -> list[str]:
    """One negative text per prompt (``None``: ``""``; one string: repeated).

    Raises:
        InvalidRequestError: a list whose length is not the number of prompts.
    """
    if negative is None:
        return [""] * len(prompts)
    if isinstance(negative, str):
        return [negative] * len(prompts)
    if len(negative) != len(prompts):
        raise InvalidRequestError(
            f"negative_prompt has {len(negative)} entries for {len(prompts)} prompts; pass one per prompt"
        )
    return list(negative)


def text_rows(num_prompts: int, cfg: bool) -> list[int]:
    """The text encoder's LoRA row layout: the prompt index of every encoded text (the prompts, then,
    with CFG, their negative texts)."""
    rows = list(range(num_prompts))
    return rows * 2 if cfg else rows


def encode_texts(
    encode: Callable[[list[str]], Any],
    prompts: list[str],
    negative: str | list[str] | None,
    cfg: bool,
    lora_context: LoRAContextFactory | None,
    lora_scale: float = 1.0,
) -> Any:
    """``encode(texts)`` of the prompts and, with CFG, their negative texts (:func:`negative_texts`),
    inside the text encoders' LoRA scope: ``lora_context(text_rows(...), component="text_encoder")``,
    so each text is encoded with its own prompt's adapters (their text-encoder parts), negative
    texts with their prompt's. ``lora_scale`` (a call-wide multiplier, 1 = none) is passed only when
    it is not 1.

    Raises:
        InvalidRequestError: see :func:`negative_texts`.
    """
    texts = list(prompts) + (negative_texts(prompts, negative) if cfg else [])
    if lora_context is None:
        return encode(texts)
    extra = {"lora_scale": lora_scale} if lora_scale != 1.0 else {}
    with lora_context(text_rows(len(prompts), cfg), component="text_encoder", **extra):
        return encode(texts)


def seeded_noise(
    shape: tuple[int, ...],
    n: int,
    sp: OmniDiffusionSamplingParams,
    num_prompts: int,
    seeds: list[int | None] | None,
    device: torch.device | str,
) -> torch.Tensor:
    """Initial noise ``(num_prompts * n, *shape)`` float32 on ``device``.

    ``sp.generator`` draws the whole batch at once (diffusers' semantics for one generator);
    otherwise prompt ``i`` draws its ``n`` samples from its own generator (``seeds[i]`` when given,
    else ``sp.make_generators``'s), so a prompt's noise does not depend on its batch neighbours.
    """
    if sp.generator is not None:
        return _randn((num_prompts * n, *shape), sp.generator, device)
    gens = sp.make_generators(num_prompts)
    if seeds is not None:
        gens = [g if seed is None else torch.Generator().manual_seed(seed) for g, seed in zip(gens, seeds)]
    return torch.cat([_randn((n, *shape), g, device) for g in gens], dim=0)


def _randn(shape: tuple[int, ...], generator, device) -> torch.Tensor:
    # only when noise is drawn: diffusers costs ~0.9 s CPU to import (pipelines/__init__.py)
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator, device=torch.device(device), dtype=torch.float32)


def denoiser_rows(num_prompts: int, n: int, cfg: bool) -> list[int]:
    """The LoRA row layout: the prompt index of every denoiser sample (``n`` per prompt, then, with
    CFG, the same again for the negative branch)."""
    rows = [i for i in range(num_prompts) for _ in range(n)]
    return rows * 2 if cfg else rows


def lora_scope(
    lora_context: LoRAContextFactory | None, rows: list[int], lora_scale: float = 1.0
) -> AbstractContextManager:
    """The LoRA context of one call (see ``pipelines.base.LoRAContextFactory``); a no-op without one.
    ``lora_scale`` (a call-wide multiplier, 1 = none) is passed only when it is not 1."""
    if lora_context is None:
        return contextlib.nullcontext()
    return lora_context(rows, lora_scale=lora_scale) if lora_scale != 1.0 else lora_context(rows)


def resolution_shift_mu(image_seq_len: int, scheduler_config: Mapping[str, Any]) -> float:
    """diffusers' ``calculate_shift``: ``mu`` linear in the image token count between
    ``(base_image_seq_len, base_shift)`` and ``(max_image_seq_len, max_shift)`` of the scheduler config."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


def prepare_scheduler(
    template,
    device: torch.device | str,
    *,
    steps: int | None = None,
    sigmas: list[float] | None = None,
    mu: float | None = None,
):
    """A fresh scheduler (``type(template).from_config``: requests never share step state) with its
    timesteps set from ``steps`` or ``sigmas`` (plus ``mu`` for dynamic shifting) and begin index 0."""
    scheduler = type(template).from_config(template.config)
    kwargs = {"mu": mu} if mu is not None else {}
    if sigmas is not None:
        scheduler.set_timesteps(sigmas=sigmas, device=device, **kwargs)
    else:
        scheduler.set_timesteps(steps, device=device, **kwargs)
    scheduler.set_begin_index(0)
    check_schedule(scheduler, steps if steps is not None else len(sigmas))
    return scheduler


def check_schedule(scheduler, steps: int) -> None:
    """Refuse a schedule with non-finite sigmas or timesteps before any denoiser call.

    The published Qwen-Image scheduler (``shift_terminal`` 0.02) at one step is the known case:
    diffusers' ``stretch_shift_to_terminal`` divides 0 by 0 there and its pipeline returns NaN latents
    (a black image); here the request is refused instead.

    Raises:
        InvalidRequestError: naming ``num_inference_steps`` and, when set, the scheduler's ``shift_terminal``.
    """
    values = [getattr(scheduler, name, None) for name in ("sigmas", "timesteps")]
    if all(v is None or bool(torch.isfinite(torch.as_tensor(v)).all()) for v in values):
        return
    terminal = scheduler.config.get("shift_terminal")
    cause = (
        f"the scheduler's shift_terminal={terminal} (scheduler_config.json) stretches the last sigma to it, "
        "which needs at least 2 steps"
        if terminal
        else f"{type(scheduler).__name__} with this model's scheduler_config.json"
    )
    raise InvalidRequestError(
        f"num_inference_steps={steps} gives a non-finite noise schedule ({cause}); "
        "ask for more num_inference_steps"
    )


def check_finite_latents(latents: torch.Tensor, steps: int) -> None:
    """Refuse to hand on latents holding NaN or inf after the denoise loop (never a black image).

    Raises:
        InvalidRequestError: naming the fields that can cause it (guidance, adapter scales, steps).
    """
    if bool(torch.isfinite(latents).all()):
        return
    raise InvalidRequestError(
        f"the denoise loop ({steps} steps) produced non-finite latents (NaN/inf): check the request's "
        "guidance_scale, adapter scales (lora scale / schedule) and num_inference_steps"
    )


def run_denoising_loop(
    scheduler,
    latents: torch.Tensor,
    predict: Predict,
    adapters: AbstractContextManager,
    *,
    progress_bar: bool = False,
) -> torch.Tensor:
    """``latents = scheduler.step(predict(i, t, latents), t, latents)`` over ``scheduler.timesteps``.

    The whole loop runs inside ``adapters`` (the LoRA scope) and a fresh diffusion forward context;
    each ``predict`` runs inside :func:`~vllm_omni.diffusion.forward_context.denoising_step` (per-step
    LoRA scale schedules read it). Returns the final latents (the scheduler's dtype: float32 in, float32 out).

    Raises:
        InvalidRequestError: the final latents are not finite (:func:`check_finite_latents`).
    """
    timesteps = scheduler.timesteps
    with adapters, set_forward_context():
        for i, t in enumerate(step_progress(timesteps, len(timesteps), "denoise", progress_bar)):
            with denoising_step(i, len(timesteps)):
                velocity = predict(i, t, latents)
            latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
    check_finite_latents(latents, len(timesteps))
    return latents


def split_by_prompt(prompts: list[str], latents: torch.Tensor, n: int) -> list[DiffusionOutput]:
    """One :class:`DiffusionOutput` per prompt with its ``n`` rows of ``latents`` (CPU)."""
    return [
        DiffusionOutput(prompt=p, latents=latents[i * n : (i + 1) * n].cpu()) for i, p in enumerate(prompts)
    ]


def attach_decoded(results: list[DiffusionOutput], decoded, output_type: str, n: int) -> None:
    """Give each result its ``n`` post-processed images: ``images`` (PIL list) or ``array``."""
    for i, res in enumerate(results):
        chunk = decoded[i * n : (i + 1) * n]
        if output_type == "pil":
            res.images = list(chunk)
        else:
            res.array = chunk


__all__ = [
    "InTreePipelineBase",
    "Predict",
    "attach_decoded",
    "check_finite_latents",
    "check_schedule",
    "denoiser_rows",
    "encode_texts",
    "load_component",
    "lora_scope",
    "negative_texts",
    "prepare_scheduler",
    "resolution_shift_mu",
    "run_denoising_loop",
    "seeded_noise",
    "split_by_prompt",
    "text_rows",
]
