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
from contextlib import AbstractContextManager

import torch
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel
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
from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

DEFAULT_SIZE = 1024
DEFAULT_GUIDANCE = 5.0

logger = logging.getLogger(__name__)


#: kept for callers of the old name (diffusers' ``calculate_shift``)
image_shift_mu = resolution_shift_mu


class ZImagePipeline(InTreePipelineBase):
    """Z-Image text-to-image on the in-tree denoiser (one instance per TP rank).

    Attributes:
        transformer: the :class:`ZImageTransformer2DModel` (patch point for LoRA).
        text_encoder, tokenizer, vae, scheduler: the reused library components.
        vae_scale_factor: spatial down-sampling of the VAE (8 for 4 blocks); image sizes
            must be multiples of ``2 * vae_scale_factor``.

    Must be constructed after ``init_diffusion_parallel_state`` in the same process.
    """

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
    def encode_prompts(self, prompts: list[str], max_sequence_length: int = 512) -> list[torch.Tensor]:
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

    def resolve_size(self, sp: OmniDiffusionSamplingParams) -> tuple[int, int]:
        """``(height, width)`` after defaults (:attr:`default_size`).

        Raises:
            InvalidRequestError: a side that is not a multiple of ``2 * vae_scale_factor`` or
                exceeds :attr:`max_image_size`.
        """
        return resolve_image_size(sp, self.default_size, self.vae_scale_factor * 2, self.max_image_size)

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
        """Generate ``sp.num_images_per_prompt`` images for each prompt (one denoiser batch).

        Args:
            prompts: the texts.
            sp: shared settings (``negative_prompt`` may hold one text per prompt).
            seeds: one seed per prompt (``None`` entries: ``sp.seed`` / random) overriding
                ``sp.seed``; ignored when ``sp.generator`` is set.
            lora_context: called once, before the first step, with the prompt index of every
                denoiser sample (CFG copies included, in batch order); the returned context is
                held over all denoising steps (the LoRA worker activates adapters there). Also
                called around prompt encoding with ``component="text_encoder"`` and the prompt index
                of every encoded text (negative texts included): adapters' text-encoder parts.

        Returns one :class:`DiffusionOutput` per prompt, in order, with float32 CPU
        ``latents`` ``(n, 16, H/8, W/8)`` and, unless ``output_type="latent"``, decoded images.

        Raises:
            InvalidRequestError: bad sizes (see :meth:`resolve_size`) or negative prompt count.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            return []
        if sp.extra_args:  # never ignore an argument silently
            raise InvalidRequestError(
                f"extra_args {sorted(sp.extra_args)} are not used by the in-tree Z-Image pipeline; "
                "run the stage with pipeline_backend='diffusers' to pass pipeline-specific arguments"
            )
        height, width = self.resolve_size(sp)
        guidance = DEFAULT_GUIDANCE if sp.guidance_scale is None else float(sp.guidance_scale)
        cfg = guidance > 0
        n = sp.num_images_per_prompt
        encoded = encode_texts(
            lambda texts: self.encode_prompts(texts, sp.max_sequence_length),
            prompts,
            sp.negative_prompt,
            cfg,
            lora_context,
        )
        captions = [c for c in encoded for _ in range(n)]
        factor = self.vae_scale_factor * 2
        shape = (self.transformer.in_channels, 2 * (height // factor), 2 * (width // factor))
        latents = seeded_noise(shape, n, sp, len(prompts), seeds, self.device)
        adapters = lora_scope(lora_context, denoiser_rows(len(prompts), n, cfg))
        latents = self._denoise(latents, captions, guidance, sp.num_inference_steps, adapters)
        results = split_by_prompt(prompts, latents, n)
        if sp.output_type != "latent":
            attach_decoded(results, self.decode(latents, sp.output_type), sp.output_type, n)
        return results

    def _denoise(
        self,
        latents: torch.Tensor,
        captions: list[torch.Tensor],
        guidance: float,
        steps: int,
        adapters: AbstractContextManager,
    ) -> torch.Tensor:
        """Run the flow-matching loop on ``latents`` ``(B, 16, H/8, W/8)`` float32; ``captions`` holds
        ``B`` positive then (with CFG, ``guidance > 0``) ``B`` negative caption features. Returns
        the final latents, float32."""
        batch = latents.shape[0]
        cfg = guidance > 0
        mu = resolution_shift_mu((latents.shape[2] // 2) * (latents.shape[3] // 2), self.scheduler.config)
        sigmas = torch.linspace(1.0, 1.0 / steps, steps).tolist()
        scheduler = prepare_scheduler(self.scheduler, self.device, sigmas=sigmas, mu=mu)

        def predict(_step: int, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            t_model = (1000 - t.expand(batch)) / 1000
            x = x.to(self.transformer.dtype)
            if cfg:
                x, t_model = x.repeat(2, 1, 1, 1), t_model.repeat(2)
            out = self.transformer(list(x.unsqueeze(2).unbind(0)), t_model, captions)
            out = torch.stack([o.float() for o in out]).squeeze(2)
            pred = out[:batch] + guidance * (out[:batch] - out[batch:]) if cfg else out
            return -pred

        return run_denoising_loop(
            scheduler, latents, predict, adapters, progress_bar=self.od_config.enable_progress_bar
        )

    def decode(self, latents: torch.Tensor, output_type: str):
        """VAE-decode ``latents`` (``latents / scaling_factor + shift_factor``) and post-process them
        into ``output_type`` (``"pil"`` list, ``"np"`` array, ``"pt"`` tensor)."""
        decoded = self.vae.decode(
            (latents.to(self.vae.dtype) / self.vae.config.scaling_factor) + self.vae.config.shift_factor,
            return_dict=False,
        )[0]
        return self.image_processor.postprocess(decoded, output_type=output_type)
