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
for the call, as diffusers' argument); anything else is refused naming the key. The sampling loop is the
family template's (:class:`~vllm_omni.diffusion.pipelines.template.DiTPipeline`); the hooks below are
Flux's: the template's CFG scale is ``true_cfg_scale`` (default 1, off), the request's ``guidance_scale``
is the distilled guidance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.models.flux.flux_transformer import FluxTransformer2DModel
from vllm_omni.diffusion.pipelines import diffusers_dtype_kwargs
from vllm_omni.diffusion.pipelines.base import resolve_image_size
from vllm_omni.diffusion.pipelines.denoise import attach_decoded, load_component, resolution_shift_mu
from vllm_omni.diffusion.pipelines.template import DenoiseState, DiTPipeline, RequestOptions
from vllm_omni.errors import ConfigError, InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

#: diffusers' defaults: distilled guidance, T5 token limit, sample size in latent pixels (x8: 1024 px)
DEFAULT_GUIDANCE = 3.5
T5_MAX_LENGTH = 512
DEFAULT_SAMPLE_SIZE = 128


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
        size: the output ``(height, width)`` in pixels (Kontext's sizing).
    """

    latents: torch.Tensor
    ids: torch.Tensor
    size: tuple[int, int]


class FluxPipeline(DiTPipeline):
    """Flux text-to-image on the in-tree denoiser (one instance per TP rank); see the module docstring.

    Attributes:
        transformer: the :class:`FluxTransformer2DModel` (patch point for LoRA).
        text_encoder / tokenizer (CLIP), text_encoder_2 / tokenizer_2 (T5), vae, scheduler,
        image_processor: the library components. vae_scale_factor: 8; sizes must be multiples of 16.

    Must be constructed after ``init_diffusion_parallel_state`` in the same process.
    """

    family = "flux"
    extra_args_taken: tuple[str, ...] = ()

    def __init__(self, od_config: OmniDiffusionConfig, device: str | torch.device | None = None):
        from transformers import AutoTokenizer

        root = self._load_text_and_scheduler(od_config, device)
        self.tokenizer_2 = AutoTokenizer.from_pretrained(str(root / "tokenizer_2"))
        spec = od_config.components.get("text_encoder_2")
        if spec is None:
            raise ConfigError(f"{root}: Flux needs its T5 text encoder (model_index.json text_encoder_2)")
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

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_text_features(
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

    # ------------------------------------------------------------------ template hooks
    def parse_options(self, sp: OmniDiffusionSamplingParams) -> RequestOptions:
        """The template's options with Flux's meaning of the two scales: the CFG scale is
        ``extra_args["true_cfg_scale"]`` (default 1: off); ``guidance_scale`` (default 3.5) is the
        distilled guidance, kept in ``options.extra["guidance"]``."""
        extra = {**sp.extra_args, "true_cfg_scale": sp.extra_args.get("true_cfg_scale", 1.0)}
        options = super().parse_options(dataclasses.replace(sp, guidance_scale=None, extra_args=extra))
        options.extra["guidance"] = (
            DEFAULT_GUIDANCE if sp.guidance_scale is None else float(sp.guidance_scale)
        )
        return options

    def default_guidance(self) -> float:
        """diffusers' ``true_cfg_scale`` default: 1.0 (no CFG)."""
        return 1.0

    def cfg_enabled(self, guidance: float, sp: OmniDiffusionSamplingParams) -> bool:
        """True CFG runs when ``true_cfg_scale > 1`` and a negative prompt is given (diffusers' rule)."""
        return guidance > 1 and sp.negative_prompt is not None

    def resolve_size(
        self, sp: OmniDiffusionSamplingParams, condition: ImageCondition | None
    ) -> tuple[int, int]:
        """``(height, width)``: Kontext's (``condition.size``), else the request's, else :attr:`default_size`.

        Raises:
            InvalidRequestError: a side that is not a multiple of ``2 * vae_scale_factor`` (named).
        """
        if condition is not None:
            return condition.size
        return resolve_image_size(sp, self.default_size, self.vae_scale_factor * 2)

    def latent_size(self, options: RequestOptions) -> tuple[int, int]:
        """``(lat_h, lat_w)``: the VAE latent rows and columns of the output (even)."""
        factor = self.vae_scale_factor * 2
        return 2 * (options.height // factor), 2 * (options.width // factor)

    def noise_shape(self, options: RequestOptions, condition) -> tuple[int, ...]:
        """``(in_channels / 4, lat_h, lat_w)``: diffusers draws the noise unpacked, then packs it."""
        return (self.transformer.in_channels // 4, *self.latent_size(options))

    def schedule_kwargs(self, options: RequestOptions, noise_shape) -> dict:
        """Sigmas ``linspace(1, 1/steps, steps)`` (none with ``use_flow_sigmas``), ``mu`` from the output's
        packed token count (ignored by schedulers without dynamic shifting, as schnell's)."""
        steps = options.steps
        mu = resolution_shift_mu((noise_shape[-2] // 2) * (noise_shape[-1] // 2), self.scheduler.config)
        if self.scheduler.config.get("use_flow_sigmas"):
            return {"steps": steps, "mu": mu}
        return {"sigmas": np.linspace(1.0, 1 / steps, steps), "mu": mu}

    def encode_prompts(self, texts: list[str], options: RequestOptions, sp, condition):
        """``(T5 features, pooled CLIP output)`` of ``texts`` (see :meth:`encode_text_features`)."""
        return self.encode_text_features(texts, sp.max_sequence_length)

    def build_state(self, state: DenoiseState, sp) -> None:
        """Position ids of the output (and Kontext's input image) tokens, the text's, the output's token count."""
        lat_h, lat_w = self.latent_size(state.options)
        ids = image_ids(lat_h // 2, lat_w // 2, device=self.device)
        if state.condition is not None:
            ids = torch.cat([ids, state.condition.ids.to(ids)], dim=0)
        state.extra["img_ids"] = ids
        state.extra["txt_ids"] = torch.zeros(state.text[0].shape[1], 3, device=self.device)
        state.extra["tokens"] = (lat_h // 2) * (lat_w // 2)

    def init_latents(self, noise: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        """The noise packed into 2x2 patches ``(B, N, 64)``."""
        return pack_latents(noise)

    def model_input(
        self, state: DenoiseState, latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """The rows' tokens in the denoiser dtype, Kontext's input-image tokens appended."""
        x = latents.to(self.transformer.dtype)
        if state.condition is not None:
            x = torch.cat([x, state.condition.latents.to(x.dtype).expand(x.shape[0], -1, -1)], dim=1)
        return x

    def predict(self, state: DenoiseState, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The denoiser at ``t / 1000`` with the distilled guidance (guidance-embedding checkpoints);
        the output image's tokens only, float32."""
        embeds, pooled = state.text
        timestep = timesteps.to(torch.float32) / 1000
        guidance = None
        if self.transformer.guidance_embeds:
            guidance = torch.full((x.shape[0],), state.options.extra["guidance"], device=x.device)
        out = self.transformer(
            x, embeds, pooled, timestep, state.extra["img_ids"], state.extra["txt_ids"], guidance
        )
        return out[:, : state.extra["tokens"]].float()

    def decode_into(self, results, latents: torch.Tensor, state: DenoiseState, sp) -> None:
        """Unpack, VAE-decode and attach the images."""
        lat_h, lat_w = self.latent_size(state.options)
        attach_decoded(
            results, self.decode(latents, lat_h, lat_w, sp.output_type), sp.output_type, state.options.n
        )

    def decode(self, latents: torch.Tensor, lat_h: int, lat_w: int, output_type: str):
        """Unpack, de-normalise (``latents / scaling_factor + shift_factor``), VAE-decode and post-process."""
        config = self.vae.config
        x = unpack_latents(latents, lat_h, lat_w).to(self.vae.dtype)
        image = self.vae.decode(x / config.scaling_factor + config.shift_factor, return_dict=False)[0]
        return self.image_processor.postprocess(image, output_type=output_type)
