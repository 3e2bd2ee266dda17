"""In-tree Z-Image denoiser."""

from vllm_omni.diffusion.models.z_image.z_image_transformer import ZImageTransformer2DModel

__all__ = ["ZImageTransformer2DModel"]
