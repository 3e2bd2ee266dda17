"""Text-to-image Z-Image pipeline around the in-tree tensor-parallel denoiser.

Components come from one diffusers-format directory (``model_index.json``): the
tokenizer and text encoder through ``transformers``, ``AutoencoderKL`` and the flow-match
scheduler through ``diffusers``, and the denoiser from
:class:`~vllm_omni.diffusion.models.z_image.ZImageTransformer2DModel`. The sampling
procedure reproduces diffusers' ``ZImagePipeline``:

1. each prompt is wrapped in the tokenizer's chat template (user turn, generation
   prompt, ``enable_thinking=True``), tokenised to ``max_sequence_length`` and encoded;
   the second-to-last hidden state at non-padding positions is the caption.
2. CFG runs when ``guidance_scale > 0`` with ``pred = pos + g * (pos - neg)`` (negative
   prompt defaults to ``""``), both branches in one denoiser batch.
3. sigmas ``linspace(1, 1/steps, steps)`` are resolution-shifted by the scheduler (``mu``
   from the image token count); the denoiser sees ``t = (1000 - timestep) / 1000`` and
   its output is negated before the Euler step.
4. latents are decoded as ``vae.decode(latents / scaling_factor + shift_factor)``.
"""

from __future__ import annotations

import logging

import torch
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel
from vllm_omni.diffusion.pipelines import diffusers_dtype_kwargs
from vllm_omni.diffusion.pipelines.base import resolve_image_size
from vllm_omni.diffusion.pipelines.denoise import attach_decoded, resolution_shift_mu
from vllm_omni.diffusion.pipelines.template import DenoiseState, DiTPipeline, RequestOptions
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

DEFAULT_SIZE = 1024
DEFAULT_GUIDANCE = 5.0

logger = logging.getLogger(__name__)


#: kept for callers of the old name (diffusers' ``calculate_shift``)
image_shift_mu = resolution_shift_mu


class ZImagePipeline(DiTPipeline):
    """Z-Image text-to-image on the in-tree denoiser (one instance per TP rank).

    Attributes:
        transformer: the :class:`ZImageTransformer2DModel` (patch point for LoRA).
        text_encoder, tokenizer, vae, scheduler: the reused library components.
        vae_scale_factor: spatial down-sampling of the VAE (8 for 4 blocks); image sizes
            must be multiples of ``2 * vae_scale_factor``.

    Must be constructed after ``init_diffusion_parallel_state`` in the same process. ``generate`` is the
    template's (:class:`~vllm_omni.diffusion.pipelines.template.DiTPipeline`); this class fills its hooks.
    """

    family = "z_image"

    def __init__(self, od_config: OmniDiffusionConfig, device: str | torch.device | None = None):
        root = self._load_text_and_scheduler(od_config, device)
        self.vae = AutoencoderKL.from_pretrained(str(root / "vae"), **diffusers_dtype_kwargs(self.dtype))
        self.vae.to(self.device).eval().requires_grad_(False)
        self.transformer = ZImageTransformer2DModel.from_pretrained(
            root / "transformer",
            dtype=self.dtype,
            device=self.device,
            keep_base_weights=od_config.keep_base_weights,
        )
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_captions(self, prompts: list[str], max_sequence_length: int = 512) -> list[torch.Tensor]:
        """Caption features per prompt: ``(L_i, hidden)`` in the text encoder dtype, padding removed.

        Like diffusers, a prompt is truncated to ``max_sequence_length`` tokens; it is also cut
        (with a warning) to :attr:`max_prompt_tokens`, what the denoiser's positional table holds.
        """
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=True,
            )
            for p in prompts
        ]
        enc = self.tokenizer(
            texts, padding="max_length", max_length=max_sequence_length, truncation=True, return_tensors="pt"
        )
        ids = enc.input_ids.to(self.device)
        mask = enc.attention_mask.to(self.device).bool()
        hidden = self.text_encoder(
            input_ids=ids, attention_mask=mask, output_hidden_states=True
        ).hidden_states[-2]
        captions = [hidden[i][mask[i]] for i in range(len(prompts))]
        # The text encoder is causal: keeping the first rows equals encoding the truncated text.
        limit = self.max_prompt_tokens
        for i, cap in enumerate(captions):
            if cap.shape[0] > limit:
                logger.warning(
                    "prompt %d has %d tokens with its chat template; this model's positional table holds "
                    "%d caption tokens, so the rest is truncated",
                    i,
                    cap.shape[0],
                    limit,
                )
                captions[i] = cap[:limit]
        return captions

    # ------------------------------------------------------------------ checks
    @property
    def max_prompt_tokens(self) -> int:
        """Caption tokens (chat template included) the denoiser's positional table can index."""
        return self.transformer.position_limits()[0]

    @property
    def max_image_size(self) -> tuple[int, int]:
        """Largest ``(height, width)`` in pixels the denoiser's positional tables can index."""
        _, lat_h, lat_w = self.transformer.position_limits()
        return lat_h * self.vae_scale_factor, lat_w * self.vae_scale_factor

    @property
    def default_size(self) -> tuple[int, int]:
        """``(height, width)`` of a request without a size: the VAE's ``sample_size`` (1024 for
        Z-Image, as in diffusers), else 1024; bounded by :attr:`max_image_size`."""
        factor = self.vae_scale_factor * 2
        sample = self.vae.config.get("sample_size")
        size = sample if isinstance(sample, int) and sample > 0 and not sample % factor else DEFAULT_SIZE
        return tuple(min(size, limit) // factor * factor for limit in self.max_image_size)

    def resolve_size(self, sp: OmniDiffusionSamplingParams, condition=None) -> tuple[int, int]:
        """``(height, width)`` after defaults (:attr:`default_size`).

        Raises:
            InvalidRequestError: a side that is not a multiple of ``2 * vae_scale_factor`` or
                exceeds :attr:`max_image_size`.
        """
        return resolve_image_size(sp, self.default_size, self.vae_scale_factor * 2, self.max_image_size)

    # ------------------------------------------------------------------ template hooks
    def default_guidance(self) -> float:
        """diffusers' ``ZImagePipeline`` default: 5.0."""
        return DEFAULT_GUIDANCE

    def cfg_enabled(self, guidance: float, sp: OmniDiffusionSamplingParams) -> bool:
        """CFG runs when ``guidance > 0`` (diffusers' rule for Z-Image)."""
        return guidance > 0

    def noise_shape(self, options: RequestOptions, condition) -> tuple[int, int, int]:
        """``(16, H/8, W/8)`` (latent channels, latent rows, latent columns)."""
        factor = self.vae_scale_factor * 2
        return (self.transformer.in_channels, 2 * (options.height // factor), 2 * (options.width // factor))

    def schedule_kwargs(self, options: RequestOptions, noise_shape) -> dict:
        """Sigmas ``linspace(1, 1/steps, steps)`` shifted with ``mu`` from the image token count."""
        steps = options.steps
        mu = resolution_shift_mu((noise_shape[1] // 2) * (noise_shape[2] // 2), self.scheduler.config)
        return {"sigmas": torch.linspace(1.0, 1.0 / steps, steps).tolist(), "mu": mu}

    def encode_prompts(self, texts: list[str], options: RequestOptions, sp, condition) -> list[torch.Tensor]:
        """Caption features per text (see :meth:`encode_captions`)."""
        return self.encode_captions(texts, sp.max_sequence_length)

    def predict(self, state: DenoiseState, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The denoiser on the rows (one image per row, its caption) at ``(1000 - t) / 1000``, float32."""
        t_model = (1000 - timesteps) / 1000
        out = self.transformer(list(x.unsqueeze(2).unbind(0)), t_model, state.text)
        return torch.stack([o.float() for o in out]).squeeze(2)

    def combine_cfg(self, state: DenoiseState, out: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Z-Image's CFG: ``pos + g * (pos - neg)``."""
        batch = out.shape[0] // 2
        return out[:batch] + state.options.guidance * (out[:batch] - out[batch:])

    def to_velocity(self, pred: torch.Tensor) -> torch.Tensor:
        """The scheduler steps on the negated prediction (diffusers' ``-noise_pred``)."""
        return -pred

    def decode_into(self, results, latents: torch.Tensor, state: DenoiseState, sp) -> None:
        """VAE-decode and attach the images."""
        attach_decoded(results, self.decode(latents, sp.output_type), sp.output_type, state.options.n)

    def decode(self, latents: torch.Tensor, output_type: str):
        """VAE-decode ``latents`` (``latents / scaling_factor + shift_factor``) and post-process them
        into ``output_type`` (``"pil"`` list, ``"np"`` array, ``"pt"`` tensor)."""
        decoded = self.vae.decode(
            (latents.to(self.vae.dtype) / self.vae.config.scaling_factor) + self.vae.config.shift_factor,
            return_dict=False,
        )[0]
        return self.image_processor.postprocess(decoded, output_type=output_type)
