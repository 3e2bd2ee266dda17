"""Wan image-to-video (Wan2.1 I2V with a CLIP image encoder, Wan2.2 A14B I2V with two experts, Wan2.2 TI2V-5B)
on the in-tree denoiser.

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

Wan2.2 TI2V-5B (``expand_timesteps`` in ``model_index.json``) instead: only the image is VAE-encoded (one
latent frame, normalised); the denoiser sees no extra channels, but its input's first latent frame is that
clean image latent every step, the tokens of that frame get timestep 0 (the others the step's), and the
result's first latent frame is the image latent again (:class:`~vllm_omni.diffusion.pipelines.wan.Conditioning`).
That layout takes no ``last_image`` (diffusers ignores one; here it is refused, named).
"""

from __future__ import annotations

import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.pipelines.denoise import load_component
from vllm_omni.diffusion.pipelines.wan import EXTRA_ARGS, Conditioning, WanPipeline
from vllm_omni.errors import ConfigError, InvalidRequestError

#: the input image(s) of a request, diffusers' call arguments of the same names
IMAGE_ARGS = ("image", "last_image")


class WanImageToVideoPipeline(WanPipeline):
    """Wan image-to-video on the in-tree denoiser(s); see the module docstring.

    Attributes (beyond :class:`WanPipeline`'s): ``image_encoder`` / ``image_processor`` (transformers'
    ``CLIPVisionModel`` / ``CLIPImageProcessor``) when the directory has them, else ``None``;
    ``expand_timesteps``: the Wan2.2 TI2V-5B layout (``model_index.json``).

    Raises:
        ConfigError: (construction) image cross-attention in the denoiser without an image encoder in the
            directory.
    """

    accepts_image = True
    extra_args_taken = EXTRA_ARGS + IMAGE_ARGS

    def __init__(self, od_config: OmniDiffusionConfig, device: str | torch.device | None = None):
        super().__init__(od_config, device)
        self.expand_timesteps = bool(od_config.model_index.get("expand_timesteps"))
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

    def _input_images(self, sp) -> list:
        """``[image]`` or ``[image, last_image]`` from ``extra_args``.

        Raises:
            InvalidRequestError: no ``image`` (naming the argument to pass); a ``last_image`` for the
                ``expand_timesteps`` layout.
        """
        image = sp.extra_args.get("image")
        if image is None:
            raise InvalidRequestError(
                "WanImageToVideoPipeline needs an input image: pass extra_args['image'] (a PIL image, "
                "numpy array or tensor)"
            )
        last = sp.extra_args.get("last_image")
        if last is not None and self.expand_timesteps:
            raise InvalidRequestError(
                "extra_args['last_image'] is not used by expand_timesteps image-to-video (Wan2.2 TI2V-5B "
                "conditions on the first frame only); pass extra_args['image'] alone"
            )
        return [image] if last is None else [image, last]

    @torch.no_grad()
    def _conditioning(self, sp, shape, frames: int, height: int, width: int) -> Conditioning:
        """For the batch of ``shape``: ``channels`` ``(B, 4 + z_dim, f, h, w)`` float32 and ``image_embeds``
        ``(k, L, d)`` (with an image encoder), or with ``expand_timesteps`` ``first_frame`` ``(B, z_dim, 1, h, w)``."""
        images = self._input_images(sp)
        try:
            pixels = [
                self.video_processor.preprocess(im, height=height, width=width).to(self.device, torch.float32)
                for im in images
            ]
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"extra_args['image'] cannot be read as an image: {exc}") from exc
        if self.expand_timesteps:
            return Conditioning(first_frame=self._encode(pixels[0].unsqueeze(2)).repeat(shape[0], 1, 1, 1, 1))
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

    def _encode(self, video: torch.Tensor) -> torch.Tensor:
        """The VAE latent (the distribution's mode) of ``video`` ``(1, 3, F, H, W)``, float32, normalised
        ``(z - mean) / std``."""
        latent = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode().to(torch.float32)
        mean, inv_std = self.latent_stats(latent)
        return (latent - mean) * inv_std
