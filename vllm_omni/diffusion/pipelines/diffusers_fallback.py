"""Generic fallback: any diffusers text-to-image or text-to-video pipeline (SD3, Flux, Wan, ...) run as-is.

No tensor parallelism; the denoiser is whatever diffusers loads (``transformer`` or
``unet``), exposed as :attr:`DiffusersFallbackPipeline.transformer` for patching.

LoRA controls where diffusers users give them: the ``"scale"`` entry of ``joint_attention_kwargs``
(SD3, Flux), ``cross_attention_kwargs`` (UNet pipelines) or ``attention_kwargs`` (Wan, ...) in a
request's ``extra_args`` multiplies the scale of every adapter of the call, as diffusers'
``scale_lora_layers`` does for the adapters it loaded; the rest of the dict reaches diffusers.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
from diffusers import DiffusionPipeline

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.pipelines import diffusers_dtype_kwargs
from vllm_omni.diffusion.pipelines.base import LoRAContextFactory, check_image_side
from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

#: diffusers call arguments whose ``"scale"`` entry is the LoRA scale of the whole call.
LORA_SCALE_KWARGS = ("joint_attention_kwargs", "cross_attention_kwargs", "attention_kwargs")


def pop_lora_scale(kwargs: dict) -> float:
    """Remove the ``"scale"`` entries of :data:`LORA_SCALE_KWARGS` from ``kwargs`` (in place; the
    dicts are copied) and return their product (``1.0`` when none is given).

    Raises:
        InvalidRequestError: such an argument that is not a dict, or a scale that is not a finite number.
    """
    product = 1.0
    for key in LORA_SCALE_KWARGS:
        value = kwargs.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise InvalidRequestError(f"extra_args[{key!r}] must be a dict, got {type(value).__name__}")
        if "scale" not in value:
            continue
        scale = value["scale"]
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise InvalidRequestError(
                f"extra_args[{key!r}]['scale'] (the LoRA scale of the call) must be a finite number, got {scale!r:.80}"
            )
        product *= float(scale)
        rest = {k: v for k, v in value.items() if k != "scale"}
        if rest:
            kwargs[key] = rest
        else:
            del kwargs[key]
    return product


class DiffusersFallbackPipeline:
    """Wraps ``DiffusionPipeline.from_pretrained(od_config.model)``.

    Components stored as ``[null, null]`` in ``model_index.json`` (e.g. SD3 without T5)
    are passed as ``None``. Sampling parameters map to the diffusers call arguments of
    the same name; those the pipeline does not accept are left out when unset. Video
    pipelines (whose output carries ``.frames``, e.g. Wan) take ``num_images_per_prompt``
    as ``num_videos_per_prompt`` and return their frames in :attr:`DiffusionOutput.videos`.
    """

    #: The denoiser batch layout is diffusers' own: every prompt of a call shares one adapter set.
    mixed_lora_batch = False

    def __init__(self, od_config: OmniDiffusionConfig, device: str | torch.device | None = None):
        self.od_config = od_config
        self.device = torch.device(device or od_config.resolved_device())
        absent = {name: None for name, spec in od_config.components.items() if spec is None}
        self.pipe = DiffusionPipeline.from_pretrained(
            od_config.model, **diffusers_dtype_kwargs(od_config.torch_dtype()), **absent
        )
        self.pipe.to(self.device)
        self.pipe.set_progress_bar_config(disable=not od_config.enable_progress_bar)
        self._accepted = set(inspect.signature(self.pipe.__call__).parameters)

    @property
    def output_kind(self) -> str:
        """``"video"`` when the diffusers pipeline's call takes ``num_frames`` (Wan, CogVideoX,
        LTX, ...), else ``"image"``."""
        return "video" if "num_frames" in self._accepted else "image"

    @property
    def accepts_image(self) -> bool:
        """Whether the diffusers pipeline's call takes an input ``image`` (image-to-image / -video)."""
        return "image" in self._accepted

    @property
    def transformer(self) -> torch.nn.Module | None:
        """The denoiser module (``pipe.transformer`` or ``pipe.unet``)."""
        return getattr(self.pipe, "transformer", None) or getattr(self.pipe, "unet", None)

    @property
    def transformer_2(self) -> torch.nn.Module | None:
        """The second denoiser of dual-transformer pipelines (e.g. Wan2.2 MoE), else ``None``."""
        return getattr(self.pipe, "transformer_2", None)

    @property
    def vae_scale_factor(self) -> int:
        """Spatial VAE compression (``vae_scale_factor``, or ``vae_scale_factor_spatial`` of video pipelines)."""
        value = getattr(self.pipe, "vae_scale_factor", None)
        if value is None:
            value = getattr(self.pipe, "vae_scale_factor_spatial", 8)
        return int(value)

    def _kwargs(self, sp: OmniDiffusionSamplingParams) -> dict:
        wanted = {
            "height": sp.height,
            "width": sp.width,
            "num_inference_steps": sp.num_inference_steps,
            "guidance_scale": sp.guidance_scale,
            "negative_prompt": sp.negative_prompt,
            "num_images_per_prompt": sp.num_images_per_prompt,
            "output_type": sp.output_type,
            **sp.extra_args,
        }
        if "num_images_per_prompt" not in self._accepted and "num_videos_per_prompt" in self._accepted:
            wanted["num_videos_per_prompt"] = wanted.pop("num_images_per_prompt")
        kwargs = {}
        for key, value in wanted.items():
            if value is None:
                continue
            if key not in self._accepted:
                raise InvalidRequestError(
                    f"{type(self.pipe).__name__} does not accept {key!r}; leave it unset"
                )
            kwargs[key] = value
        if "max_sequence_length" in self._accepted and sp.max_sequence_length != 512:
            kwargs["max_sequence_length"] = sp.max_sequence_length
        return kwargs

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        sp: OmniDiffusionSamplingParams,
        *,
        seeds: list[int | None] | None = None,
        lora_context: LoRAContextFactory | None = None,
    ) -> list[DiffusionOutput]:
        """Run the diffusers pipeline on all prompts in one call; one :class:`DiffusionOutput` per prompt.

        ``seeds`` (one per prompt) override ``sp.seed``; ``lora_context(None)`` and
        ``lora_context(None, component="text_encoder")`` (the adapters' text-encoder parts, on the
        diffusers pipeline's text encoders) are entered around the whole diffusers call (all prompts
        share one adapter set here), with ``lora_scale`` when ``extra_args`` carries a LoRA scale
        (module docstring; diffusers scales its text-encoder LoRA by it too).

        With ``seed`` set each prompt gets its own generator seeded identically (so a
        prompt's result does not depend on its batch). ``latents`` is filled only for
        ``output_type="latent"`` (``(n, C, h, w)``, float32 CPU; video pipelines
        ``(n, C, f, h, w)``). Video pipelines fill ``videos`` (one list of PIL frames per
        video) for ``output_type="pil"`` and ``array`` (``(n, frames, ...)``) otherwise.

        Raises:
            InvalidRequestError: height/width not multiples of ``vae_scale_factor * 2``, an argument
                the pipeline does not take, or a LoRA scale that is not a finite number.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            return []
        for name in ("height", "width"):
            check_image_side(name, getattr(sp, name), self.vae_scale_factor * 2)
        n = sp.num_images_per_prompt
        kwargs = self._kwargs(sp)
        if sp.generator is not None:
            kwargs["generator"] = sp.generator
        else:
            # One generator per image; each prompt's n images come from its own seeded stream.
            gens = []
            per_prompt = sp.make_generators(len(prompts))
            for i, g in enumerate(per_prompt):
                if seeds is not None and seeds[i] is not None:
                    g = torch.Generator().manual_seed(seeds[i])
                gens.extend([g] * n)
            kwargs["generator"] = gens
        lora_scale = pop_lora_scale(kwargs)
        with contextlib.ExitStack() as adapters:
            if lora_context is not None:  # one adapter set for the whole call: denoiser and text encoders
                extra = {"lora_scale": lora_scale} if lora_scale != 1.0 else {}
                adapters.enter_context(lora_context(None, **extra))
                adapters.enter_context(lora_context(None, component="text_encoder", **extra))
            out = self.pipe(prompt=list(prompts), **kwargs)
        is_video = getattr(out, "images", None) is None and getattr(out, "frames", None) is not None
        images = out.frames if is_video else out.images
        results = []
        for i, prompt in enumerate(prompts):
            chunk = images[i * n : (i + 1) * n]
            res = DiffusionOutput(prompt=prompt)
            if sp.output_type == "latent":
                res.latents = chunk.float().cpu()
            elif sp.output_type == "pil" and is_video:
                res.videos = [list(frames) for frames in chunk]
            elif sp.output_type == "pil":
                res.images = list(chunk)
            else:
                res.array = chunk
            results.append(res)
        return results
