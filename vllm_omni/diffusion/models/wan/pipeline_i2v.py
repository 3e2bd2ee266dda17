"""Wan image-to-video (Wan2.1 I2V with a CLIP image encoder, Wan2.2 A14B I2V with two experts, Wan2.2 TI2V-5B)
on the in-tree denoiser.

Everything of :class:`~vllm_omni.diffusion.models.wan.pipeline.WanPipeline` (prompts, CFG, experts, LoRA rows,
decoding) plus diffusers' ``WanImageToVideoPipeline`` conditioning, step for step:

1. the request's ``extra_args["image"]`` (and optional ``"last_image"``, first/last-frame models) is resized
   by ``VideoProcessor.preprocess`` to the request size; the video ``[image, zeros..., (last_image)]`` of
   ``num_frames`` frames is encoded by the VAE (the distribution's mode) and normalised
   ``(z - mean) / std``;
2. a mask over latent frames (1 for the given frames, in the VAE's temporal groups) is put in front:
   the denoiser sees ``[noise latents (16), mask (4), image latents (16)]`` channels every step;
3. with an ``image_encoder`` (Wan2.1 I2V) the CLIP features (``hidden_states[-2]``) of the image(s)
   feed the denoiser's image cross-attention.

Wan2.2 TI2V-5B (``expand_timesteps`` in ``model_index.json``) instead: only the image is VAE-encoded (one
latent frame, normalised); the denoiser sees no extra channels, but its input's first latent frame is that
clean image latent every step, the tokens of that frame get timestep 0 (the others the step's), and the
result's first latent frame is the image latent again (:class:`~vllm_omni.diffusion.models.wan.pipeline.Conditioning`).
That layout takes no ``last_image`` (diffusers ignores one; here it is refused, named). The published
TI2V-5B folder names ``WanPipeline``, which serves it with an optional image (:mod:`~.wan`); a folder naming
``WanImageToVideoPipeline`` runs here and needs the image, as diffusers' class does.
"""

from __future__ import annotations

import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.models.wan.pipeline import EXTRA_ARGS, IMAGE_ARGS, Conditioning, WanPipeline
from vllm_omni.diffusion.pipelines.denoise import load_component
from vllm_omni.errors import ConfigError

__all__ = ["IMAGE_ARGS", "WanImageToVideoPipeline"]


class WanImageToVideoPipeline(WanPipeline):
    """Wan image-to-video on the in-tree denoiser(s); see the module docstring.

    Attributes (beyond :class:`WanPipeline`'s): ``image_encoder`` / ``image_processor`` (transformers'
    ``CLIPVisionModel`` / ``CLIPImageProcessor``) when the directory has them, else ``None``; every request
    needs an image (``requires_image``).

    Raises:
        ConfigError: (construction) image cross-attention in the denoiser without an image encoder in the
            directory.
    """

    accepts_image = requires_image = True

    def __init__(self, od_config: OmniDiffusionConfig, device: str | torch.device | None = None):
        super().__init__(od_config, device)
        self.accepts_image = self.requires_image = True
        self.extra_args_taken = EXTRA_ARGS + IMAGE_ARGS
        comps = od_config.components
        self.image_encoder = self.image_processor = None
        if comps.get("image_encoder"):
            self.image_processor = load_component(
                od_config.model, "image_processor", comps["image_processor"]
            )
            self.image_encoder = load_component(
                od_config.model, "image_encoder", comps["image_encoder"], dtype=self.dtype
            )
            self.image_encoder.to(self.device).eval().requires_grad_(False)
        if self.transformer.accepts_image_embeds and self.image_encoder is None:
            raise ConfigError(
                f"{od_config.model}: the denoiser has image cross-attention but no image_encoder"
            )

    @torch.no_grad()
    def _conditioning(self, sp, shape, frames: int, height: int, width: int) -> Conditioning:
        """For the batch of ``shape``: ``channels`` ``(B, 4 + z_dim, f, h, w)`` float32 and ``image_embeds``
        ``(k, L, d)`` (with an image encoder), or with ``expand_timesteps`` ``first_frame`` ``(B, z_dim, 1, h, w)``."""
        if self.expand_timesteps:
            return super()._conditioning(sp, shape, frames, height, width)
        images = self._input_images(sp)
        pixels = self._pixels(images, height, width)
        zeros = pixels[0].new_zeros(1, pixels[0].shape[1], frames - len(pixels), height, width)
        video = torch.cat([pixels[0].unsqueeze(2), zeros, *(p.unsqueeze(2) for p in pixels[1:])], dim=2)
        latent = self._encode(video)
        lat_h, lat_w = latent.shape[3:]
        t = self.vae_scale_factor_temporal
        mask = torch.ones(1, 1, frames, lat_h, lat_w, device=self.device)
        mask[:, :, 1 : frames - (len(pixels) - 1)] = 0
        mask = torch.cat([mask[:, :, :1].repeat_interleave(t, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(1, -1, t, lat_h, lat_w).transpose(1, 2)
        channels = torch.cat([mask, latent], dim=1).repeat(shape[0], 1, 1, 1, 1)
        image_embeds = None
        if self.transformer.accepts_image_embeds:
            features = self.image_processor(images=images, return_tensors="pt").to(self.device)
            hidden = self.image_encoder(**features, output_hidden_states=True).hidden_states[-2]
            image_embeds = hidden.to(self.transformer.dtype)
        return Conditioning(channels, image_embeds)
