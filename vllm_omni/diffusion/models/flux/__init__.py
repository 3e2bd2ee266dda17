"""In-tree Flux denoiser (FLUX.1-dev, FLUX.1-schnell, FLUX.1-Kontext)."""

from vllm_omni.diffusion.models.flux.flux_transformer import FluxTransformer2DModel

__all__ = ["FluxTransformer2DModel"]
