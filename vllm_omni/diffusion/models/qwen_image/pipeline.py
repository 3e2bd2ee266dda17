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

from dataclasses import dataclass

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.image_processor import VaeImageProcessor

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.models.qwen_image import QwenImageTransformer2DModel
from vllm_omni.diffusion.pipelines import diffusers_dtype_kwargs
from vllm_omni.diffusion.pipelines.base import resolve_image_size
from vllm_omni.diffusion.pipelines.denoise import attach_decoded, resolution_shift_mu
from vllm_omni.diffusion.pipelines.template import DenoiseState, DiTPipeline, RequestOptions
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


class QwenImagePipeline(DiTPipeline):
    """Qwen-Image text-to-image on the in-tree denoiser (one instance per TP rank).

    Attributes:
        transformer: the :class:`QwenImageTransformer2DModel` (patch point for LoRA).
        text_encoder, tokenizer, vae, scheduler, image_processor: the library components.
        vae_scale_factor: spatial VAE compression (8); sizes must be multiples of twice it.

    Must be constructed after ``init_diffusion_parallel_state`` in the same process.
    """

    family = "qwen_image"
    #: the prompt template, the tokens dropped from its start and the family's own ``extra_args``
    prompt_template = PROMPT_TEMPLATE
    template_drop = TEMPLATE_DROP
    extra_args_taken: tuple[str, ...] = ()

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
        self, sp: OmniDiffusionSamplingParams, condition: ImageCondition | None = None
    ) -> tuple[int, int]:
        """``(height, width)``: the request's, else the input image's size (edit), else :attr:`default_size`.

        Raises:
            InvalidRequestError: a side that is not a multiple of ``2 * vae_scale_factor``.
        """
        default = condition.size if condition is not None else self.default_size
        return resolve_image_size(sp, default, self.vae_scale_factor * 2)

    def _condition(self, sp: OmniDiffusionSamplingParams) -> ImageCondition | None:
        """The request's input image (text to image: none)."""
        return None

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_text_features(
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

    # ------------------------------------------------------------------ template hooks
    def default_guidance(self) -> float:
        """diffusers' ``true_cfg_scale`` default: 4.0."""
        return DEFAULT_TRUE_CFG

    def cfg_enabled(self, guidance: float, sp: OmniDiffusionSamplingParams) -> bool:
        """True CFG runs when the scale is ``> 1`` and a negative prompt is given (diffusers' rule)."""
        return guidance > 1 and sp.negative_prompt is not None

    def prepare_condition(
        self, sp: OmniDiffusionSamplingParams, options: RequestOptions
    ) -> ImageCondition | None:
        """The request's input image (text to image: none)."""
        return self._condition(sp)

    def latent_size(self, options: RequestOptions) -> tuple[int, int]:
        """``(lat_h, lat_w)``: the VAE latent rows and columns of the output (even)."""
        factor = self.vae_scale_factor * 2
        return 2 * (options.height // factor), 2 * (options.width // factor)

    def noise_shape(self, options: RequestOptions, condition) -> tuple[int, ...]:
        """``(1, z_dim, lat_h, lat_w)``: diffusers draws the noise frame-first, then packs it."""
        return (1, self.vae.config.z_dim, *self.latent_size(options))

    def schedule_kwargs(self, options: RequestOptions, noise_shape) -> dict:
        """Sigmas ``linspace(1, 1/steps, steps)`` shifted with ``mu`` from the packed token count."""
        steps = options.steps
        tokens = (noise_shape[-2] // 2) * (noise_shape[-1] // 2)
        mu = resolution_shift_mu(tokens, self.scheduler.config)
        return {"sigmas": np.linspace(1.0, 1 / steps, steps), "mu": mu}

    def encode_prompts(self, texts: list[str], options: RequestOptions, sp, condition):
        """``(features, mask)`` of ``texts`` (see :meth:`encode_text_features`)."""
        return self.encode_text_features(texts, sp.max_sequence_length, condition)

    def build_state(self, state: DenoiseState, sp) -> None:
        """The RoPE image shapes of every denoiser row and the output's token count."""
        lat_h, lat_w = self.latent_size(state.options)
        grids = [(lat_h // 2, lat_w // 2)] + ([state.condition.grid] if state.condition else [])
        rows = state.batch * (2 if state.options.cfg else 1)
        state.extra["shapes"] = [[(1, *grid) for grid in grids]] * rows
        state.extra["tokens"] = (lat_h // 2) * (lat_w // 2)

    def init_latents(self, noise: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        """The noise packed into 2x2 patches ``(B, N, 64)``."""
        return pack_latents(noise)

    def model_input(
        self, state: DenoiseState, latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """The rows' tokens in the denoiser dtype, the input image's tokens appended (edit)."""
        x = latents.to(self.transformer.dtype)
        if state.condition is not None:
            cond = state.condition.latents.to(x.dtype).expand(x.shape[0], -1, -1)
            x = torch.cat([x, cond], dim=1)
        return x

    def predict(self, state: DenoiseState, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The denoiser at ``t / 1000`` (the timestep cast to the denoiser dtype first, as diffusers);
        the output image's tokens only, float32."""
        timestep = timesteps.to(self.transformer.dtype) / 1000
        embeds, mask = state.text
        out = self.transformer(x, embeds, mask, timestep, state.extra["shapes"])
        return out[:, : state.extra["tokens"]].float()

    def combine_cfg(self, state: DenoiseState, out: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Qwen-Image's true CFG (:func:`true_cfg`)."""
        return true_cfg(out, out.shape[0] // 2, state.options.guidance)

    def decode_into(self, results, latents: torch.Tensor, state: DenoiseState, sp) -> None:
        """Unpack, VAE-decode and attach the images."""
        lat_h, lat_w = self.latent_size(state.options)
        attach_decoded(
            results, self.decode(latents, lat_h, lat_w, sp.output_type), sp.output_type, state.options.n
        )

    def decode(self, latents: torch.Tensor, lat_h: int, lat_w: int, output_type: str):
        """Unpack, de-normalise (``latents * std + mean``), VAE-decode and post-process packed ``latents``."""
        config = self.vae.config
        x = unpack_latents(latents, lat_h, lat_w).to(self.vae.dtype)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(x)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(x)
        image = self.vae.decode(x / inv_std + mean, return_dict=False)[0][:, :, 0]
        return self.image_processor.postprocess(image, output_type=output_type)
