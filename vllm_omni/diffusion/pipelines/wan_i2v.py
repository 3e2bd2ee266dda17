"""Wan image-to-video (Wan2.1 I2V with a CLIP image encoder, Wan2.2 A14B I2V with two experts) on the in-tree denoiser.

Everything of :class:`~vllm_omni.diffusion.pipelines.wan.WanPipeline` (prompts, CFG, experts, LoRA rows,
decoding) plus diffusers' ``WanImageToVideoPipeline`` conditioning, step for step:

1. the request's ``extra_args["image"]`` (and optional ``"last_image"``, first/last-frame models) is resized
   by ``VideoProcessor.preprocess`` to the request size; the video ``[image, zeros..., (last_image)]`` of
   ``num_frames`` frames is encoded by the VAE (the distribution's mode) and normalised
   ``(z - mean) / std``;
2. a mask over latent frames (1 for the given frames, in the VAE's temporal groups) is put in front:
   the denoiser sees ``[noise latents (16), mask (4), image latents (16)]`` channels every step;
3. with an ``image_encoder`` (Wan2.1 I2V) the CLIP features (``hidden_states[-2]``) of the image(s)
   feed the denoiser's image cross-attention.

Wan2.2 TI2V-5B image-to-video (``expand_timesteps``: per-token timesteps, the first latent frame kept
clean) is not implemented in-tree; such a directory is refused at start with the fallback named.
"""

from __future__ import annotations

import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.pipelines.denoise import load_component
from vllm_omni.diffusion.pipelines.wan import EXTRA_ARGS, WanPipeline
from vllm_omni.errors import ConfigError, InvalidRequestError

#: the input image(s) of a request, diffusers' call arguments of the same names
IMAGE_ARGS = ("image", "last_image")


class WanImageToVideoPipeline(WanPipeline):
    """Wan image-to-video on the in-tree denoiser(s); see the module docstring.

    Attributes (beyond :class:`WanPipeline`'s): ``image_encoder`` / ``image_processor`` (transformers'
    ``CLIPVisionModel`` / ``CLIPImageProcessor``) when the directory has them, else ``None``.

    Raises:
        ConfigError: (construction) an ``expand_timesteps`` (TI2V-5B) directory, or image cross-attention
            in the denoiser without an image encoder in the directory.
    """

    accepts_image = True
    extra_args_taken = EXTRA_ARGS + IMAGE_ARGS

    def __init__(self, od_config: OmniDiffusionConfig, device: str | torch.device | None = None):
        if od_config.model_index.get("expand_timesteps"):
            raise ConfigError(
                f"{od_config.model}: expand_timesteps image-to-video (Wan2.2 TI2V-5B) is not in-tree; "
                "run the stage with pipeline_backend='auto' or 'diffusers'"
            )
        super().__init__(od_config, device)
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

    @staticmethod
    def _input_images(sp) -> list:
        """``[image]`` or ``[image, last_image]`` from ``extra_args``.

        Raises:
            InvalidRequestError: no ``image`` (naming the argument to pass).
        """
        image = sp.extra_args.get("image")
        if image is None:
            raise InvalidRequestError(
                "WanImageToVideoPipeline needs an input image: pass extra_args['image'] (a PIL image, "
                "numpy array or tensor)"
            )
        last = sp.extra_args.get("last_image")
        return [image] if last is None else [image, last]

    @torch.no_grad()
    def _conditioning(self, sp, shape, frames: int, height: int, width: int):
        """``(channels (B, 4 + z_dim, f, h, w) float32, image_embeds (k, L, d) | None)`` for the batch of ``shape``."""
        images = self._input_images(sp)
        try:
            pixels = [
                self.video_processor.preprocess(im, height=height, width=width).to(self.device, torch.float32)
                for im in images
            ]
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"extra_args['image'] cannot be read as an image: {exc}") from exc
        zeros = pixels[0].new_zeros(1, pixels[0].shape[1], frames - len(pixels), height, width)
        video = torch.cat([pixels[0].unsqueeze(2), zeros, *(p.unsqueeze(2) for p in pixels[1:])], dim=2)
        latent = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode().to(torch.float32)
        mean, inv_std = self.latent_stats(latent)
        latent = (latent - mean) * inv_std
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
        return channels, image_embeds
