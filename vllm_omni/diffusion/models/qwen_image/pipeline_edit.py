"""Qwen-Image image edit (diffusers' ``QwenImageEditPipeline``) around the in-tree denoiser.

The text-to-image pipeline (:mod:`.qwen_image`) with an input image, as diffusers'
``QwenImageEditPipeline.__call__`` does it (the reference of the parity tests):

1. the input image is resized to about :attr:`QwenImageEditPipeline.condition_area` pixels at its
   aspect ratio (diffusers' ``calculate_dimensions``: sides multiples of 32); that is also the
   default output size.
2. the vision-language encoder reads it with the prompt: the edit template (its first 64 tokens
   dropped) with ``<|vision_start|><|image_pad|><|vision_end|>``, expanded by the Qwen2-VL processor;
   the last hidden state at the real tokens is the prompt feature.
3. the VAE encodes it (the distribution's mode), normalised ``(z - mean) / std`` and packed; its
   tokens are appended to every sample's noisy tokens (a second image in the RoPE, frame index 1),
   and only the first tokens of the prediction (the output image's) are kept.

The image comes in ``extra_args["image"]`` (a PIL image; the HTTP ``/v1/images/edits`` route puts
the uploaded one there). The processor is transformers' Qwen2-VL processor; without torchvision it
is loaded without its video processor (:func:`vllm_omni.models.torchvision_free.load_qwen2_vl_processor`).
"""

from __future__ import annotations

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.models.qwen_image.pipeline import ImageCondition, QwenImagePipeline, pack_latents
from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.models.torchvision_free import load_qwen2_vl_processor

#: diffusers ``QwenImageEditPipeline.prompt_template_encode`` and the tokens it drops
EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
EDIT_TEMPLATE_DROP = 64


class QwenImageEditPipeline(QwenImagePipeline):
    """Qwen-Image edit on the in-tree denoiser (one instance per TP rank); see the module docstring.

    Attributes (beyond :class:`QwenImagePipeline`'s):
        processor: the Qwen2-VL processor (image patches and ``<|image_pad|>`` expansion).
        condition_area: pixels the input image is resized to (diffusers: 1024 * 1024).
    """

    accepts_image = True
    prompt_template = EDIT_PROMPT_TEMPLATE
    template_drop = EDIT_TEMPLATE_DROP
    extra_args_taken = ("image",)
    condition_area = 1024 * 1024

    def __init__(self, od_config: OmniDiffusionConfig, device: str | torch.device | None = None):
        super().__init__(od_config, device)
        self.processor = load_qwen2_vl_processor(str(self.od_config.model) + "/processor")
        self.latent_channels = self.vae.config.z_dim

    def _condition(self, sp: OmniDiffusionSamplingParams) -> ImageCondition:
        """Resize, VAE-encode and pack ``extra_args["image"]``.

        Raises:
            InvalidRequestError: no input image, or not a PIL image.
        """
        from PIL import Image

        image = sp.extra_args.get("image")
        if image is None:
            raise InvalidRequestError(
                "QwenImageEditPipeline needs an input image: pass extra_args={'image': <PIL image>} "
                "(HTTP: POST /v1/images/edits with an 'image' file)"
            )
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"extra_args['image'] must be a PIL image, got {type(image).__name__}")
        width, height, _ = calculate_dimensions(self.condition_area, image.size[0] / image.size[1])
        resized = self.image_processor.resize(image, height, width)
        pixels = self.image_processor.preprocess(resized, height, width).unsqueeze(2)
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist
        z = dist.mode()
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, self.latent_channels, 1, 1, 1).to(z)
        std = torch.tensor(config.latents_std).view(1, self.latent_channels, 1, 1, 1).to(z)
        latents = pack_latents((z - mean) / std).float()
        factor = self.vae_scale_factor * 2
        return ImageCondition(resized, latents, (height // factor, width // factor), (height, width))

    def _encoder_hidden(
        self, texts: list[str], condition: ImageCondition | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Last hidden state of the templated ``texts``, each with the input image, and the attention mask."""
        inputs = self.processor(
            text=texts, images=[condition.prompt_image] * len(texts), padding=True, return_tensors="pt"
        ).to(self.device)
        out = self.text_encoder(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            output_hidden_states=True,
        )
        return out.hidden_states[-1], inputs["attention_mask"]
