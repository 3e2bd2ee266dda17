"""Text-to-image Qwen-Image pipeline around the in-tree tensor-parallel denoiser.

Components come from one diffusers-format directory (``model_index.json``): the ``Qwen2Tokenizer``
and ``Qwen2_5_VLForConditionalGeneration`` text encoder through ``transformers``,
``AutoencoderKLQwenImage``, ``FlowMatchEulerDiscreteScheduler`` and ``VaeImageProcessor`` through
``diffusers``, and the denoiser from
:class:`~vllm_omni.diffusion.models.qwen_image.QwenImageTransformer2DModel`. The sampling procedure
is diffusers' ``QwenImagePipeline.__call__`` (the reference of the parity tests):

1. each prompt is put in Qwen-Image's system/user template, tokenised (at most 1024 tokens after the
   template's first 34, which are dropped) and encoded; the text encoder's last hidden state at the
   real tokens is the prompt feature, cut to ``max_sequence_length``.
2. true CFG runs when the scale is ``> 1`` and a negative prompt is given:
   ``comb = neg + s * (pos - neg)``, rescaled per token to the norm of ``pos``
   (``pred = comb * |pos| / |comb|``); both branches go through the denoiser in one batch
   (text padded to the longer branch and masked).
3. sigmas ``linspace(1, 1/steps, steps)`` shifted by the scheduler with ``mu`` from the packed token
   count; the denoiser sees ``t / 1000``.
4. latents ``(B, 16, 1, H/8, W/8)`` are packed into 2x2 patches ``(B, H/16 * W/16, 64)``, and for
   decoding unpacked and de-normalised: ``vae.decode(latents * std + mean)``.

The CFG scale is ``extra_args["true_cfg_scale"]`` (diffusers' argument) when given, else the request's
``guidance_scale``, else 4.0 (diffusers' default). ``extra_args`` may also carry
``attention_kwargs={"scale": s}`` (a LoRA scale for the call); anything else is refused.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.image_processor import VaeImageProcessor

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.models.qwen_image import QwenImageTransformer2DModel
from vllm_omni.diffusion.pipelines import diffusers_dtype_kwargs
from vllm_omni.diffusion.pipelines.base import LoRAContextFactory, resolve_image_size
from vllm_omni.diffusion.pipelines.denoise import (
    InTreePipelineBase,
    attach_decoded,
    denoiser_rows,
    encode_texts,
    lora_scope,
    prepare_scheduler,
    resolution_shift_mu,
    run_denoising_loop,
    seeded_noise,
    split_by_prompt,
)
from vllm_omni.diffusion.pipelines.diffusers_fallback import pop_lora_scale
from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

#: diffusers ``QwenImagePipeline.prompt_template_encode`` and the tokens it drops
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEMPLATE_DROP = 34
TOKENIZER_MAX_LENGTH = 1024
DEFAULT_TRUE_CFG = 4.0
#: ``default_sample_size`` of diffusers' pipeline, in latent pixels (times the VAE factor: 1024 px)
DEFAULT_SAMPLE_SIZE = 128
EXTRA_ARGS = ("true_cfg_scale", "attention_kwargs")


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``(B, 1, C, h, w)`` noise (diffusers draws it frame-first) or ``(B, C, 1, h, w)`` VAE latents ->
    ``(B, h/2 * w/2, 4C)``: 2x2 patches, channel-major inside a patch (diffusers' ``_pack_latents``)."""
    b, c, h, w = latents.shape[0], latents.shape[1] * latents.shape[2], latents.shape[3], latents.shape[4]
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, lat_h: int, lat_w: int) -> torch.Tensor:
    """``(B, N, 4C)`` -> ``(B, C, 1, lat_h, lat_w)`` (the VAE's layout; diffusers' ``_unpack_latents``)."""
    b, _, c4 = latents.shape
    x = latents.view(b, lat_h // 2, lat_w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, 1, lat_h, lat_w)


def true_cfg(out: torch.Tensor, batch: int, scale: float) -> torch.Tensor:
    """diffusers' Qwen-Image true CFG on a ``[pos; neg]`` batch ``(2B, N, C)``: ``neg + s (pos - neg)``
    rescaled per token to ``|pos|`` (norms over the last dim)."""
    pos, neg = out[:batch], out[batch:]
    comb = neg + scale * (pos - neg)
    return comb * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


@dataclass(frozen=True)
class ImageCondition:
    """An input image as the edit pipeline feeds it (see ``qwen_image_edit``).

    Attributes:
        prompt_image: the resized image for the vision-language encoder (PIL).
        latents: its packed, normalised VAE latents ``(1, N_c, 64)`` float32.
        grid: its patch grid ``(h, w)``. size: the default output ``(height, width)`` in pixels.
    """

    prompt_image: object
    latents: torch.Tensor
    grid: tuple[int, int]
    size: tuple[int, int]


class QwenImagePipeline(InTreePipelineBase):
    """Qwen-Image text-to-image on the in-tree denoiser (one instance per TP rank).

    Attributes:
        transformer: the :class:`QwenImageTransformer2DModel` (patch point for LoRA).
        text_encoder, tokenizer, vae, scheduler, image_processor: the library components.
        vae_scale_factor: spatial VAE compression (8); sizes must be multiples of twice it.

    Must be constructed after ``init_diffusion_parallel_state`` in the same process.
    """

    #: the prompt template, the tokens dropped from its start and the ``extra_args`` taken
    prompt_template = PROMPT_TEMPLATE
    template_drop = TEMPLATE_DROP
    extra_args_taken = EXTRA_ARGS

    def __init__(self, od_config: OmniDiffusionConfig, device: str | torch.device | None = None):
        root = self._load_text_and_scheduler(od_config, device)
        self.vae = AutoencoderKLQwenImage.from_pretrained(
            str(root / "vae"), **diffusers_dtype_kwargs(self.dtype)
        )
        self.vae.to(self.device).eval().requires_grad_(False)
        self.transformer = QwenImageTransformer2DModel.from_pretrained(
            root / "transformer",
            dtype=self.dtype,
            device=self.device,
            keep_base_weights=od_config.keep_base_weights,
        )
        self.vae_scale_factor = 2 ** len(self.vae.temperal_downsample)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    @property
    def default_size(self) -> tuple[int, int]:
        """``(height, width)`` of a request without a size: 1024 x 1024, as diffusers."""
        side = DEFAULT_SAMPLE_SIZE * self.vae_scale_factor
        return side, side

    def resolve_size(
        self, sp: OmniDiffusionSamplingParams, default: tuple[int, int] | None = None
    ) -> tuple[int, int]:
        """``(height, width)``: the request's, else ``default`` (else :attr:`default_size`).

        Raises:
            InvalidRequestError: a side that is not a multiple of ``2 * vae_scale_factor``.
        """
        return resolve_image_size(sp, default or self.default_size, self.vae_scale_factor * 2)

    def _condition(self, sp: OmniDiffusionSamplingParams) -> ImageCondition | None:
        """The request's input image (text to image: none)."""
        return None

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_prompts(
        self, prompts: list[str], max_sequence_length: int, condition: ImageCondition | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features (P, L, hidden), mask (P, L) int64)``: the text encoder's last hidden state at each
        prompt's tokens after the template's first :attr:`template_drop`, zero-padded to the longest
        (``L``, at most ``max_sequence_length``); ``mask`` is 1 at real tokens.

        Raises:
            InvalidRequestError: ``max_sequence_length > 1024`` (as diffusers).
        """
        if max_sequence_length > TOKENIZER_MAX_LENGTH:
            raise InvalidRequestError(
                f"max_sequence_length must be at most {TOKENIZER_MAX_LENGTH} for Qwen-Image, got {max_sequence_length}"
            )
        texts = [self.prompt_template.format(p) for p in prompts]
        hidden, mask = self._encoder_hidden(texts, condition)
        mask = mask.bool()
        drop = self.template_drop
        feats = [hidden[i][mask[i]][drop:][:max_sequence_length] for i in range(len(prompts))]
        length = max(f.shape[0] for f in feats)
        out = hidden.new_zeros(len(feats), length, hidden.shape[-1])
        out_mask = torch.zeros(len(feats), length, dtype=torch.long, device=self.device)
        for i, f in enumerate(feats):
            out[i, : f.shape[0]] = f
            out_mask[i, : f.shape[0]] = 1
        return out, out_mask

    def _encoder_hidden(
        self, texts: list[str], condition: ImageCondition | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Last hidden state ``(P, T, hidden)`` of the templated ``texts`` and their attention mask."""
        enc = self.tokenizer(
            texts,
            max_length=TOKENIZER_MAX_LENGTH + self.template_drop,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        out = self.text_encoder(
            input_ids=enc.input_ids, attention_mask=enc.attention_mask, output_hidden_states=True
        )
        return out.hidden_states[-1], enc.attention_mask

    def _call_options(self, sp: OmniDiffusionSamplingParams) -> tuple[float, float]:
        """``(true CFG scale, LoRA scale of the call)`` from ``sp`` (module docstring).

        Raises:
            InvalidRequestError: an ``extra_args`` key this pipeline does not take, or a bad value.
        """
        extra = dict(sp.extra_args)
        lora_scale = pop_lora_scale(extra)
        unknown = sorted(set(extra) - set(self.extra_args_taken) | ({"attention_kwargs"} & set(extra)))
        if unknown:
            raise InvalidRequestError(
                f"extra_args {unknown} are not used by the in-tree {type(self).__name__} "
                f"(it takes {list(self.extra_args_taken)}, attention_kwargs only with 'scale'); run the stage with "
                "pipeline_backend='diffusers' to pass other diffusers arguments"
            )
        scale = extra.get("true_cfg_scale", sp.guidance_scale)
        if scale is None:
            return DEFAULT_TRUE_CFG, lora_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not np.isfinite(scale):
            raise InvalidRequestError(f"extra_args['true_cfg_scale'] must be a finite number, got {scale!r}")
        return float(scale), lora_scale

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        sp: OmniDiffusionSamplingParams,
        *,
        seeds: list[int | None] | None = None,
        lora_context: LoRAContextFactory | None = None,
    ) -> list[DiffusionOutput]:
        """``sp.num_images_per_prompt`` images per prompt, all prompts (and CFG branches) in one denoiser batch.

        Args:
            prompts: the texts. sp: shared settings (``negative_prompt`` may hold one text per prompt).
            seeds: per-prompt seeds overriding ``sp.seed`` (ignored with ``sp.generator``).
            lora_context: entered once around the loop with each denoiser sample's prompt index
                (CFG copies included).

        Returns one :class:`DiffusionOutput` per prompt: float32 CPU ``latents`` packed as diffusers'
        ``output_type="latent"`` gives them, ``(n, H/16 * W/16, 64)``; unless ``output_type="latent"``
        also the decoded ``images`` (``"pil"``) or ``array``.

        Raises:
            InvalidRequestError: bad sizes, negative prompt count, ``extra_args`` or sequence length.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            return []
        scale, lora_scale = self._call_options(sp)
        cond = self._condition(sp)
        height, width = self.resolve_size(sp, cond.size if cond else None)
        cfg = scale > 1 and sp.negative_prompt is not None
        n = sp.num_images_per_prompt
        embeds, mask = encode_texts(
            lambda texts: self.encode_prompts(texts, sp.max_sequence_length, cond),
            prompts,
            sp.negative_prompt,
            cfg,
            lora_context,
        )
        embeds, mask = embeds.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        lat_h, lat_w = (2 * (side // (self.vae_scale_factor * 2)) for side in (height, width))
        shape = (1, self.vae.config.z_dim, lat_h, lat_w)
        latents = pack_latents(seeded_noise(shape, n, sp, len(prompts), seeds, self.device))
        adapters = lora_scope(lora_context, denoiser_rows(len(prompts), n, cfg), lora_scale)
        grids = [(lat_h // 2, lat_w // 2)] + ([cond.grid] if cond else [])
        latents = self._denoise(
            latents,
            (embeds, mask),
            grids,
            scale if cfg else None,
            sp,
            adapters,
            cond.latents if cond else None,
        )
        results = split_by_prompt(prompts, latents, n)
        if sp.output_type != "latent":
            attach_decoded(results, self.decode(latents, lat_h, lat_w, sp.output_type), sp.output_type, n)
        return results

    def _denoise(
        self,
        latents: torch.Tensor,
        text: tuple[torch.Tensor, torch.Tensor],
        grids: list[tuple[int, int]],
        cfg_scale: float | None,
        sp: OmniDiffusionSamplingParams,
        adapters: AbstractContextManager,
        condition: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The flow-matching loop on packed ``latents`` ``(B, N, 64)`` float32; ``text`` holds ``B``
        positive then (with CFG, ``cfg_scale`` set) ``B`` negative features and their mask; ``grids``
        are the patch grids ``(h, w)`` of the output and, with ``condition`` (packed input-image
        latents ``(1, N_c, 64)``, appended to every sample's tokens), of the input image.
        Returns the final packed latents, float32."""
        batch = latents.shape[0]
        embeds, mask = text
        steps = sp.num_inference_steps
        mu = resolution_shift_mu(latents.shape[1], self.scheduler.config)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        scheduler = prepare_scheduler(self.scheduler, self.device, sigmas=sigmas, mu=mu)
        shapes = [[(1, *grid) for grid in grids]] * embeds.shape[0]
        tokens = latents.shape[1]

        def predict(_step: int, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            # diffusers casts the timestep to the latents' (= the denoiser's) dtype before dividing
            timestep = t.expand(batch).to(self.transformer.dtype) / 1000
            x = x.to(self.transformer.dtype)
            if condition is not None:
                x = torch.cat([x, condition.to(x.dtype).expand(batch, -1, -1)], dim=1)
            if cfg_scale is not None:
                x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
            out = self.transformer(x, embeds, mask, timestep, shapes)[:, :tokens].float()
            return true_cfg(out, batch, cfg_scale) if cfg_scale is not None else out

        return run_denoising_loop(
            scheduler, latents, predict, adapters, progress_bar=self.od_config.enable_progress_bar
        )

    def decode(self, latents: torch.Tensor, lat_h: int, lat_w: int, output_type: str):
        """Unpack, de-normalise (``latents * std + mean``), VAE-decode and post-process packed ``latents``."""
        config = self.vae.config
        x = unpack_latents(latents, lat_h, lat_w).to(self.vae.dtype)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(x)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(x)
        image = self.vae.decode(x / inv_std + mean, return_dict=False)[0][:, :, 0]
        return self.image_processor.postprocess(image, output_type=output_type)
