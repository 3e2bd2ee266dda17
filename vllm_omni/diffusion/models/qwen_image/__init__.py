"""In-tree Qwen-Image denoiser."""

from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import QwenImageTransformer2DModel

__all__ = ["QwenImageTransformer2DModel"]
