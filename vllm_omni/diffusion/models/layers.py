"""Small building blocks shared by the in-tree diffusion denoisers (Z-Image, Qwen-Image, ...).

Only what is bit-for-bit the same maths in more than one model lives here; each model keeps its
own blocks. Formulas follow diffusers (``diffusers.models.normalization.RMSNorm``,
``diffusers.models.embeddings.get_timestep_embedding``) so fp32 parity tests can be tight.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim with a learned ``weight`` of shape ``(dim,)``.

    ``y = x * rsqrt(mean(x^2) + eps) * weight``, statistics in float32; in float16/bfloat16 the
    normalised value is cast to the weight dtype before the product (as diffusers' ``RMSNorm``).
    Input ``(..., dim)`` of any float dtype; output in the promoted dtype.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv_rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        out = x * inv_rms
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            out = out.to(self.weight.dtype)
        return out * self.weight


def linear_out(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Call a vLLM linear layer (which returns ``(output, bias)``) or a torch one; the output only.

    vLLM layers built with ``skip_bias_add=False`` (every layer here) have already added the bias.
    """
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def timestep_sinusoid(
    t: torch.Tensor,
    dim: int,
    *,
    flip_sin_to_cos: bool,
    downscale_freq_shift: float,
    scale: float = 1.0,
    max_period: float = 10000.0,
) -> torch.Tensor:
    """diffusers' ``get_timestep_embedding``: ``(B,)`` -> ``(B, dim)`` float32 ``[sin, cos]`` features.

    Frequencies ``exp(-log(max_period) * i / (dim/2 - downscale_freq_shift))`` stay float32 and
    angles are ``scale * float(t) * f``, as diffusers computes them, whatever ``t``'s dtype: int64
    timesteps (``UniPCMultistepScheduler``, the published Wan scheduler) and bfloat16 ones give the
    same features as diffusers (casting the frequencies to an integer dtype would truncate all but
    the first to 0). ``flip_sin_to_cos`` puts the cosines first. ``dim`` must be even.
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(exponent / (half - downscale_freq_shift))
    angles = scale * (t[:, None].float() * freqs[None, :])
    emb = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    return emb


__all__ = ["RMSNorm", "linear_out", "timestep_sinusoid"]
