"""In-tree Wan (2.1 / 2.2) video denoiser on vLLM tensor-parallel layers."""

from vllm_omni.diffusion.models.wan.wan_transformer import WanTransformer3DModel, WanTransformerBlock

__all__ = ["WanTransformer3DModel", "WanTransformerBlock"]
