"""FLUX.1-Kontext image editing (diffusers' ``FluxKontextPipeline``) around the in-tree Flux denoiser.

The text-to-image pipeline (:mod:`.flux`) with an input image, as diffusers' ``FluxKontextPipeline.__call__``
does it (the reference of the parity tests):

1. the output size is the request's (default 1024 x 1024) rescaled to ``max_area`` pixels (default
   ``1024 ** 2``) at its aspect ratio, each side floored to a multiple of 16.
2. the input image is resized to the Kontext training resolution nearest its aspect ratio (diffusers'
   ``PREFERRED_KONTEXT_RESOLUTIONS``; ``_auto_resize=False`` keeps its own size), sides floored to
   multiples of 16; the VAE encodes it (the distribution's mode), ``(z - shift_factor) * scaling_factor``,
   packed into 2x2 patches with position ids ``(1, row, col)``.
3. those tokens are appended to every sample's noisy tokens; only the output tokens of the prediction
   are kept. The shift ``mu`` counts the output tokens only.

The image comes in ``extra_args["image"]`` (a PIL image; the HTTP ``/v1/images/edits`` route puts the
uploaded one there); ``extra_args`` may also carry ``max_area`` and ``_auto_resize`` (diffusers' arguments).
"""

from __future__ import annotations

import torch
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from vllm_omni.diffusion.models.flux.pipeline import FluxPipeline, ImageCondition, image_ids, pack_latents
from vllm_omni.diffusion.pipelines.template import RequestOptions
from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

DEFAULT_MAX_AREA = 1024**2


class FluxKontextPipeline(FluxPipeline):
    """FLUX.1-Kontext edits on the in-tree denoiser (one instance per TP rank); see the module docstring."""

    accepts_image = True
    extra_args_taken = ("image", "max_area", "_auto_resize")

    def family_options(self, extra: dict, options: RequestOptions) -> None:
        """``image``, ``max_area`` and ``_auto_resize`` (diffusers' arguments) into ``options.extra``.

        Raises:
            InvalidRequestError: a ``max_area`` that is not a positive number.
        """
        area = extra.get("max_area", DEFAULT_MAX_AREA)
        if isinstance(area, bool) or not isinstance(area, int | float) or not area > 0:
            raise InvalidRequestError(
                f"extra_args['max_area'] must be a positive number of pixels, got {area!r}"
            )
        options.extra.update(
            image=extra.get("image"), max_area=area, auto_resize=extra.get("_auto_resize", True)
        )

    def _output_size(self, sp: OmniDiffusionSamplingParams, area: float) -> tuple[int, int]:
        """The request's size (checked, default 1024 x 1024) rescaled to ``area`` pixels as diffusers does.

        Raises:
            InvalidRequestError: a side that is not a multiple of 16, or an area too small for one patch.
        """
        height, width = super().resolve_size(sp, None)
        aspect = width / height
        multiple = self.vae_scale_factor * 2
        width, height = round((area * aspect) ** 0.5), round((area / aspect) ** 0.5)
        width, height = width // multiple * multiple, height // multiple * multiple
        if not (height and width):
            raise InvalidRequestError(
                f"extra_args['max_area']={area} leaves no {multiple}-pixel side at aspect ratio {aspect:.3g}"
            )
        return height, width

    def prepare_condition(self, sp: OmniDiffusionSamplingParams, options: RequestOptions) -> ImageCondition:
        """Resize, VAE-encode and pack ``extra_args["image"]`` (module docstring, step 2); the output size.

        Raises:
            InvalidRequestError: no input image, or not a PIL image.
        """
        from PIL import Image

        image = options.extra["image"]
        if image is None:
            raise InvalidRequestError(
                "FluxKontextPipeline edits an input image: pass extra_args={'image': <PIL image>} "
                "(HTTP: POST /v1/images/edits with an 'image' file)"
            )
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"extra_args['image'] must be a PIL image, got {type(image).__name__}")
        size = self._output_size(sp, options.extra["max_area"])
        height, width = image.height, image.width
        if options.extra["auto_resize"]:
            aspect = width / height
            _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        multiple = self.vae_scale_factor * 2
        width, height = width // multiple * multiple, height // multiple * multiple
        if not (height and width):
            raise InvalidRequestError(
                f"extra_args['image'] of {image.size} is smaller than {multiple} pixels"
            )
        pixels = self.image_processor.preprocess(
            self.image_processor.resize(image, height, width), height, width
        )
        with torch.no_grad():
            z = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mode()
        config = self.vae.config
        latents = pack_latents((z - config.shift_factor) * config.scaling_factor).float()
        ids = image_ids(z.shape[2] // 2, z.shape[3] // 2, frame=1, device=self.device)
        return ImageCondition(latents, ids, size)
