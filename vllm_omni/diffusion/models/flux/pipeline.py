"""Flux text-to-image (diffusers' ``FluxPipeline``: FLUX.1-dev, FLUX.1-schnell) around the in-tree denoiser.

What diffusers' ``FluxPipeline.__call__`` does, which the parity tests compare against:

1. each prompt is encoded twice: the pooled output of the CLIP text encoder (``tokenizer`` padded to
   its 77 tokens) and the last hidden state of the T5 encoder (``tokenizer_2`` padded to
   ``max_sequence_length``, at most 512; no attention mask). Text position ids are zeros.
2. noise ``(B, 16, H/8, W/8)`` is packed into 2x2 patches ``(B, H/16 * W/16, 64)``; image position ids
   are ``(0, row, col)`` of each patch.
3. the sigmas ``linspace(1, 1/steps, steps)`` are shifted by the scheduler (FLUX.1-dev: dynamically
   with ``mu`` linear in the token count; schnell: its static shift 1.0); the denoiser gets
   ``t / 1000`` and, for guidance-distilled checkpoints (``guidance_embeds``: dev, Kontext), the
   request's ``guidance_scale`` (default 3.5) as its guidance input. schnell ignores ``guidance_scale``.
4. optional true CFG (``extra_args["true_cfg_scale"] > 1`` with a negative prompt): ``neg + s (pos - neg)``,
   the negative branch in the same denoiser batch.
5. decoding: unpack, ``latents / scaling_factor + shift_factor``, ``vae.decode``.

``extra_args`` may carry ``true_cfg_scale`` and ``joint_attention_kwargs={"scale": s}`` (a LoRA scale
for the call, as diffusers' argument); anything else is refused naming the key.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.models.flux import FluxTransformer2DModel
from vllm_omni.diffusion.pipelines import diffusers_dtype_kwargs
from vllm_omni.diffusion.pipelines.base import LoRAContextFactory, resolve_image_size
from vllm_omni.diffusion.pipelines.denoise import (
    InTreePipelineBase,
    attach_decoded,
    denoiser_rows,
    encode_texts,
    load_component,
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

#: diffusers' defaults: distilled guidance, T5 token limit, sample size in latent pixels (x8: 1024 px)
DEFAULT_GUIDANCE = 3.5
T5_MAX_LENGTH = 512
DEFAULT_SAMPLE_SIZE = 128
EXTRA_ARGS = ("true_cfg_scale", "joint_attention_kwargs")


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` -> ``(B, h/2 * w/2, 4C)``: 2x2 patches, channel-major inside a patch (diffusers'
    ``FluxPipeline._pack_latents``)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, lat_h: int, lat_w: int) -> torch.Tensor:
    """``(B, N, 4C)`` -> ``(B, C, lat_h, lat_w)`` (diffusers' ``_unpack_latents``)."""
    b, _, c4 = latents.shape
    x = latents.view(b, lat_h // 2, lat_w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, lat_h, lat_w)


def image_ids(grid_h: int, grid_w: int, frame: int = 0, device=None) -> torch.Tensor:
    """Position ids ``(grid_h * grid_w, 3)`` float32 of a patch grid: ``(frame, row, col)``."""
    ids = torch.zeros(grid_h, grid_w, 3, device=device)
    ids[..., 0] = frame
    ids[..., 1] = torch.arange(grid_h, device=device)[:, None]
    ids[..., 2] = torch.arange(grid_w, device=device)[None, :]
    return ids.reshape(grid_h * grid_w, 3)


@dataclass(frozen=True)
class ImageCondition:
    """An input image as Kontext feeds it (see ``flux_kontext``).

    Attributes:
        latents: its packed, normalised VAE latents ``(1, N_c, 64)`` float32.
        ids: their position ids ``(N_c, 3)`` (frame index 1).
    """

    latents: torch.Tensor
    ids: torch.Tensor


class FluxPipeline(InTreePipelineBase):
    """Flux text-to-image on the in-tree denoiser (one instance per TP rank); see the module docstring.

    Attributes:
        transformer: the :class:`FluxTransformer2DModel` (patch point for LoRA).
        text_encoder / tokenizer (CLIP), text_encoder_2 / tokenizer_2 (T5), vae, scheduler,
        image_processor: the library components. vae_scale_factor: 8; sizes must be multiples of 16.

    Must be constructed after ``init_diffusion_parallel_state`` in the same process.
    """

    extra_args_taken: tuple[str, ...] = EXTRA_ARGS

    def __init__(self, od_config: OmniDiffusionConfig, device: str | torch.device | None = None):
        from transformers import AutoTokenizer

        root = self._load_text_and_scheduler(od_config, device)
        self.tokenizer_2 = AutoTokenizer.from_pretrained(str(root / "tokenizer_2"))
        spec = od_config.components["text_encoder_2"]
        self.text_encoder_2 = load_component(root, "text_encoder_2", spec, dtype=self.dtype)
        self.text_encoder_2.to(self.device).eval().requires_grad_(False)
        self.vae = AutoencoderKL.from_pretrained(str(root / "vae"), **diffusers_dtype_kwargs(self.dtype))
        self.vae.to(self.device).eval().requires_grad_(False)
        self.transformer = FluxTransformer2DModel.from_pretrained(
            root / "transformer",
            dtype=self.dtype,
            device=self.device,
            keep_base_weights=od_config.keep_base_weights,
        )
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        self.clip_max_length = int(getattr(self.tokenizer, "model_max_length", 77) or 77)

    @property
    def default_size(self) -> tuple[int, int]:
        """``(height, width)`` of a request without a size: 1024 x 1024, as diffusers."""
        side = DEFAULT_SAMPLE_SIZE * self.vae_scale_factor
        return side, side

    def resolve_size(self, sp: OmniDiffusionSamplingParams) -> tuple[int, int]:
        """``(height, width)`` in pixels: the request's, else :attr:`default_size`.

        Raises:
            InvalidRequestError: a side that is not a multiple of ``2 * vae_scale_factor`` (named).
        """
        return resolve_image_size(sp, self.default_size, self.vae_scale_factor * 2)

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_prompts(
        self, prompts: list[str], max_sequence_length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(T5 features (P, max_sequence_length, joint_dim), pooled CLIP output (P, pooled_dim))``.

        Raises:
            InvalidRequestError: ``max_sequence_length > 512`` (as diffusers).
        """
        if max_sequence_length > T5_MAX_LENGTH:
            raise InvalidRequestError(
                f"max_sequence_length must be at most {T5_MAX_LENGTH} for Flux, got {max_sequence_length}"
            )
        clip_ids = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.clip_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        pooled = self.text_encoder(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        t5_ids = self.tokenizer_2(
            prompts,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        embeds = self.text_encoder_2(t5_ids.to(self.device), output_hidden_states=False)[0]
        return embeds.to(self.text_encoder_2.dtype), pooled.to(self.text_encoder.dtype)

    def _call_options(self, sp: OmniDiffusionSamplingParams) -> tuple[float, float, dict]:
        """``(true CFG scale, LoRA scale of the call, the other extra_args)`` of ``sp``.

        Raises:
            InvalidRequestError: an ``extra_args`` key this pipeline does not take, or a bad value.
        """
        extra = dict(sp.extra_args)
        lora_scale = pop_lora_scale(extra)
        unknown = sorted(set(extra) - set(self.extra_args_taken) | ({"joint_attention_kwargs"} & set(extra)))
        if unknown:
            raise InvalidRequestError(
                f"extra_args {unknown} are not used by the in-tree {type(self).__name__} (it takes "
                f"{list(self.extra_args_taken)}, joint_attention_kwargs only with 'scale'); run the stage with "
                "pipeline_backend='diffusers' to pass other diffusers arguments"
            )
        scale = extra.pop("true_cfg_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not np.isfinite(scale):
            raise InvalidRequestError(f"extra_args['true_cfg_scale'] must be a finite number, got {scale!r}")
        return float(scale), lora_scale, extra

    def _condition(
        self, sp: OmniDiffusionSamplingParams, extra: dict, size: tuple[int, int]
    ) -> ImageCondition | None:
        """The request's input image (text to image: none)."""
        return None

    def _output_size(self, sp: OmniDiffusionSamplingParams, extra: dict) -> tuple[int, int]:
        return self.resolve_size(sp)

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
            lora_context: entered around the text encoders and the loop with each row's prompt index.

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
        true_cfg, lora_scale, extra = self._call_options(sp)
        height, width = self._output_size(sp, extra)
        cond = self._condition(sp, extra, (height, width))
        cfg = true_cfg > 1 and sp.negative_prompt is not None
        n = sp.num_images_per_prompt
        embeds, pooled = encode_texts(
            lambda texts: self.encode_prompts(texts, sp.max_sequence_length),
            prompts,
            sp.negative_prompt,
            cfg,
            lora_context,
            lora_scale,
        )
        # [pos (P); neg (P)] -> [pos (P*n); neg (P*n)], the layout denoiser_rows reports
        embeds, pooled = embeds.repeat_interleave(n, dim=0), pooled.repeat_interleave(n, dim=0)
        lat_h, lat_w = (2 * (side // (self.vae_scale_factor * 2)) for side in (height, width))
        channels = self.transformer.in_channels // 4
        latents = pack_latents(
            seeded_noise((channels, lat_h, lat_w), n, sp, len(prompts), seeds, self.device)
        )
        adapters = lora_scope(lora_context, denoiser_rows(len(prompts), n, cfg), lora_scale)
        guidance = DEFAULT_GUIDANCE if sp.guidance_scale is None else float(sp.guidance_scale)
        ids = image_ids(lat_h // 2, lat_w // 2, device=self.device)
        latents = self._denoise(
            latents, ids, (embeds, pooled), guidance, true_cfg if cfg else None, sp, adapters, cond
        )
        results = split_by_prompt(prompts, latents, n)
        if sp.output_type != "latent":
            attach_decoded(results, self.decode(latents, lat_h, lat_w, sp.output_type), sp.output_type, n)
        return results

    def _denoise(
        self,
        latents: torch.Tensor,
        ids: torch.Tensor,
        text: tuple[torch.Tensor, torch.Tensor],
        guidance: float,
        cfg_scale: float | None,
        sp: OmniDiffusionSamplingParams,
        adapters: AbstractContextManager,
        condition: ImageCondition | None,
    ) -> torch.Tensor:
        """The flow-matching loop on packed ``latents`` ``(B, N, 64)`` float32 with position ids ``ids``
        ``(N, 3)``; ``text`` holds ``B`` positive then (with CFG, ``cfg_scale`` set) ``B`` negative T5
        features and pooled CLIP outputs; ``condition`` (Kontext) appends the input image's tokens to
        every sample. Returns the final packed latents, float32."""
        batch, tokens = latents.shape[:2]
        embeds, pooled = text
        steps = sp.num_inference_steps
        mu = resolution_shift_mu(tokens, self.scheduler.config)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if self.scheduler.config.get("use_flow_sigmas"):
            sigmas = None
        scheduler = prepare_scheduler(self.scheduler, self.device, steps=steps, sigmas=sigmas, mu=mu)
        rows = embeds.shape[0]
        guide = torch.full((rows,), guidance, dtype=torch.float32, device=self.device)
        guide = guide if self.transformer.guidance_embeds else None
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device)
        if condition is not None:
            ids = torch.cat([ids, condition.ids.to(ids)], dim=0)

        def predict(_step: int, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            timestep = t.expand(batch).to(x.dtype) / 1000
            x = x.to(self.transformer.dtype)
            if condition is not None:
                x = torch.cat([x, condition.latents.to(x.dtype).expand(batch, -1, -1)], dim=1)
            if cfg_scale is not None:
                x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
            out = self.transformer(x, embeds, pooled, timestep, ids, txt_ids, guide)[:, :tokens].float()
            if cfg_scale is None:
                return out
            pos, neg = out[:batch], out[batch:]
            return neg + cfg_scale * (pos - neg)

        return run_denoising_loop(
            scheduler, latents, predict, adapters, progress_bar=self.od_config.enable_progress_bar
        )

    def decode(self, latents: torch.Tensor, lat_h: int, lat_w: int, output_type: str):
        """Unpack, de-normalise (``latents / scaling_factor + shift_factor``), VAE-decode and post-process."""
        config = self.vae.config
        x = unpack_latents(latents, lat_h, lat_w).to(self.vae.dtype)
        image = self.vae.decode(x / config.scaling_factor + config.shift_factor, return_dict=False)[0]
        return self.image_processor.postprocess(image, output_type=output_type)
