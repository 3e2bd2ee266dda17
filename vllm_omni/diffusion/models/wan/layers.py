"""Building blocks of the in-tree Wan denoiser: norms, embedders, attention, FFN, 3-D rotary table.

Every formula follows diffusers' ``transformer_wan.py`` (``WanAttnProcessor``, ``WanAttention``,
``WanTimeTextImageEmbedding``, ``WanRotaryPosEmbed``) operation by operation, so float32 outputs
agree with diffusers to rounding. Parameter names are diffusers' checkpoint names.

Tensor parallelism: attention heads and the FFN hidden size are sharded (column-parallel
projections in, row-parallel ``to_out.0`` / ``ffn.net.2`` out, one all-reduce each); the q/k RMS
norms span *all* heads (``rms_norm_across_heads``), so :class:`HeadShardedRMSNorm` all-reduces
its sum of squares across the TP group. Embedders and the output head are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from vllm_omni.diffusion.distributed.parallel_state import get_tp_rank_and_size
from vllm_omni.diffusion.models.layers import linear_out, timestep_sinusoid
from vllm_omni.errors import ConfigError


def fp32_layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``FP32LayerNorm``: layer norm computed in float32, cast back to ``x.dtype``."""
    weight = norm.weight.float() if norm.weight is not None else None
    bias = norm.bias.float() if norm.bias is not None else None
    return F.layer_norm(x.float(), norm.normalized_shape, weight, bias, norm.eps).to(x.dtype)


class HeadShardedRMSNorm(nn.Module):
    """RMS norm over all heads of a head-sharded activation (diffusers' ``torch.nn.RMSNorm(inner_dim)``
    on q/k). Each rank holds ``inner_dim / tp`` channels and its slice of ``weight``; with TP > 1 the
    per-token sum of squares is all-reduced. ``forward(x: (..., inner_dim / tp))`` keeps shape/dtype."""

    def __init__(self, inner_dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        rank, size = get_tp_rank_and_size()
        self.inner_dim, self.eps, self.tp_size = inner_dim, eps, size
        self.local = inner_dim // size
        self.start = rank * self.local
        self.weight = nn.Parameter(torch.ones(self.local, dtype=dtype))
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.inner_dim,):
            raise ConfigError(f"RMS norm weight of shape {tuple(loaded.shape)}, expected ({self.inner_dim},)")
        param.data.copy_(loaded[self.start : self.start + self.local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.rms_norm(x, (self.local,), self.weight, self.eps)
        sumsq = tensor_model_parallel_all_reduce(x.float().pow(2).sum(-1, keepdim=True))
        return (x.float() * torch.rsqrt(sumsq / self.inner_dim + self.eps)).to(x.dtype) * self.weight


class WanRope:
    """3-D rotary table (diffusers' ``WanRotaryPosEmbed``): head channels split into frame / height /
    width parts (``h = w = 2 * (head_dim // 6)``, the frame part the rest), angles ``pos * theta^(-2i/d)``
    computed in float64 for positions ``< max_seq_len`` on each axis."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        h_dim = w_dim = 2 * (head_dim // 6)
        self.dims = (head_dim - h_dim - w_dim, h_dim, w_dim)
        self.max_seq_len = max_seq_len
        self.cos, self.sin = [], []
        for dim in self.dims:
            inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            angles = torch.outer(torch.arange(max_seq_len), inv)
            self.cos.append(angles.cos().float())
            self.sin.append(angles.sin().float())

    def grid(self, frames: int, height: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``(frames * height * width, head_dim / 2)`` float32, row-major grid order.

        Raises:
            ValueError: a grid side beyond ``max_seq_len`` (the table's reach).
        """
        sizes = (frames, height, width)
        if max(sizes) > self.max_seq_len:
            raise ValueError(
                f"patch grid {sizes} (frames, height, width) exceeds the rotary table of {self.max_seq_len} "
                "positions per axis (rope_max_seq_len)"
            )
        if self.cos[0].device != torch.device(device):
            self.cos = [c.to(device) for c in self.cos]
            self.sin = [s.to(device) for s in self.sin]

        def table(parts: list[torch.Tensor]) -> torch.Tensor:
            axes = []
            for axis, (part, n) in enumerate(zip(parts, sizes, strict=True)):
                shape = [1, 1, 1, -1]
                shape[axis] = n
                axes.append(part[:n].view(*shape).expand(*sizes, -1))
            return torch.cat(axes, dim=-1).flatten(0, 2)

        return table(self.cos), table(self.sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of ``x`` ``(B, L, H, D)`` by ``cos/sin`` ``(L, D/2)`` (diffusers' Wan order)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA on ``(B, L, H, D)`` tensors (no mask); returns ``(B, Lq, H * D)`` in ``q``'s dtype."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2).type_as(q)


class _AttentionBase(nn.Module):
    def __init__(self, dim: int, heads: int, eps: float, dtype: torch.dtype):
        super().__init__()
        _, tp_size = get_tp_rank_and_size()
        if heads % tp_size:
            raise ConfigError(
                f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp_size}"
            )
        self.head_dim = dim // heads
        self.local_heads = heads // tp_size
        self.norm_q = HeadShardedRMSNorm(dim, eps, dtype)
        self.norm_k = HeadShardedRMSNorm(dim, eps, dtype)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(2, (self.local_heads, self.head_dim))


class WanSelfAttention(_AttentionBase):
    """``attn1``: packed, head-sharded ``to_qkv`` (checkpoint ``to_q/to_k/to_v``), q/k RMS norms across
    heads, 3-D RoPE, row-parallel ``to_out.0``. ``forward(x: (B, L, dim), rope) -> (B, L, dim)``."""

    def __init__(self, dim: int, heads: int, eps: float, dtype: torch.dtype, prefix: str = ""):
        super().__init__(dim, heads, eps, dtype)
        self.to_qkv = QKVParallelLinear(
            dim, self.head_dim, heads, heads, bias=True, params_dtype=dtype, prefix=f"{prefix}.to_qkv"
        )
        self.to_out = nn.ModuleList(
            [RowParallelLinear(dim, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.to_out.0")]
        )

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = linear_out(self.to_qkv, x).chunk(3, dim=-1)
        q, k, v = self._heads(self.norm_q(q)), self._heads(self.norm_k(k)), self._heads(v)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return linear_out(self.to_out[0], _attention(q, k, v))


class WanCrossAttention(_AttentionBase):
    """``attn2``: queries from the video tokens, keys/values from the text embeddings and, for I2V
    (``added_kv_proj_dim``), a second attention over the image embeddings (``add_k_proj``,
    ``add_v_proj``, ``norm_added_k``) whose output is added. All projections column-parallel,
    ``to_out.0`` row-parallel. ``forward(x (B, L, dim), text (B, Lt, dim), image (B, Li, dim) | None)``."""

    def __init__(
        self, dim: int, heads: int, eps: float, added_kv_proj_dim: int | None, dtype, prefix: str = ""
    ):
        super().__init__(dim, heads, eps, dtype)

        def column(name: str, in_dim: int = dim) -> ColumnParallelLinear:
            return ColumnParallelLinear(in_dim, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.{name}")

        self.to_q, self.to_k, self.to_v = column("to_q"), column("to_k"), column("to_v")
        self.to_out = nn.ModuleList(
            [RowParallelLinear(dim, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.to_out.0")]
        )
        self.add_k_proj = self.add_v_proj = self.norm_added_k = None
        if added_kv_proj_dim is not None:
            self.add_k_proj = column("add_k_proj", added_kv_proj_dim)
            self.add_v_proj = column("add_v_proj", added_kv_proj_dim)
            self.norm_added_k = HeadShardedRMSNorm(dim, eps, dtype)

    def forward(self, x: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        q = self._heads(self.norm_q(linear_out(self.to_q, x)))
        k = self._heads(self.norm_k(linear_out(self.to_k, text)))
        out = _attention(q, k, self._heads(linear_out(self.to_v, text)))
        if image is not None:
            if self.add_k_proj is None:
                raise ValueError("image embeddings given to a Wan denoiser without image cross-attention")
            k_img = self._heads(self.norm_added_k(linear_out(self.add_k_proj, image)))
            out = out + _attention(q, k_img, self._heads(linear_out(self.add_v_proj, image)))
        return linear_out(self.to_out[0], out)


class _GeluProj(nn.Module):
    """diffusers' ``GELU`` activation module: ``gelu(proj(x))`` (``proj`` column-parallel or replicated)."""

    def __init__(self, proj: nn.Module, approximate: str):
        super().__init__()
        self.proj = proj
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(linear_out(self.proj, x), approximate=self.approximate)


class WanFeedForward(nn.Module):
    """diffusers' ``FeedForward`` layout (``net.0.proj`` -> GELU -> ``net.2``).

    ``parallel=True``: ``net.0.proj`` column-parallel, ``net.2`` row-parallel (the blocks' FFN, tanh
    GELU); ``False``: both replicated (the I2V image embedder, exact GELU).
    """

    def __init__(
        self, dim: int, hidden: int, out: int, dtype, approximate: str, parallel: bool, prefix: str = ""
    ):
        super().__init__()
        kwargs = {"bias": True, "params_dtype": dtype}
        if parallel:
            proj = ColumnParallelLinear(dim, hidden, prefix=f"{prefix}.net.0.proj", **kwargs)
            down = RowParallelLinear(hidden, out, prefix=f"{prefix}.net.2", **kwargs)
        else:
            proj = ReplicatedLinear(dim, hidden, prefix=f"{prefix}.net.0.proj", **kwargs)
            down = ReplicatedLinear(hidden, out, prefix=f"{prefix}.net.2", **kwargs)
        self.net = nn.ModuleList([_GeluProj(proj, approximate), nn.Identity(), down])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_out(self.net[2], self.net[0](x))


class _MLP(nn.Module):
    """``linear_2(act(linear_1(x)))`` with replicated layers (diffusers' ``TimestepEmbedding`` with
    SiLU, ``PixArtAlphaTextProjection`` with tanh GELU)."""

    def __init__(self, in_dim: int, dim: int, act, dtype, prefix: str):
        super().__init__()
        self.linear_1 = ReplicatedLinear(
            in_dim, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.linear_1"
        )
        self.linear_2 = ReplicatedLinear(dim, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.linear_2")
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_out(self.linear_2, self.act(linear_out(self.linear_1, x)))


class WanImageEmbedding(nn.Module):
    """I2V image features -> model width: FP32 LayerNorm, exact-GELU MLP, FP32 LayerNorm; an optional
    learned ``pos_embed`` over two images' tokens (first/last-frame models). ``(B, Li, image_dim)`` in."""

    def __init__(self, in_dim: int, dim: int, pos_embed_seq_len: int | None, dtype, prefix: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim, eps=1e-5, dtype=dtype)
        self.ff = WanFeedForward(in_dim, in_dim, dim, dtype, "none", parallel=False, prefix=f"{prefix}.ff")
        self.norm2 = nn.LayerNorm(dim, eps=1e-5, dtype=dtype)
        self.pos_embed = None
        if pos_embed_seq_len is not None:
            self.pos_embed = nn.Parameter(torch.zeros(1, pos_embed_seq_len, in_dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is not None:
            batch, seq_len, width = x.shape
            x = x.view(-1, 2 * seq_len, width) + self.pos_embed
        return fp32_layer_norm(self.norm2, self.ff(fp32_layer_norm(self.norm1, x)))


class WanConditionEmbedder(nn.Module):
    """diffusers' ``WanTimeTextImageEmbedding``: timestep sinusoid -> ``time_embedder`` (SiLU MLP, kept
    in float32) -> ``temb``; ``time_proj(silu(temb))`` -> the 6 modulation vectors per block; text
    (and image) features projected to the model width. All layers replicated."""

    def __init__(
        self,
        dim: int,
        freq_dim: int,
        text_dim: int,
        image_dim: int | None,
        pos_embed_seq_len: int | None,
        dtype,
        prefix: str = "condition_embedder",
    ):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embedder = _MLP(freq_dim, dim, nn.SiLU(), torch.float32, f"{prefix}.time_embedder")
        self.time_proj = ReplicatedLinear(
            dim, 6 * dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.time_proj"
        )
        gelu_tanh = nn.GELU(approximate="tanh")
        self.text_embedder = _MLP(text_dim, dim, gelu_tanh, dtype, f"{prefix}.text_embedder")
        self.image_embedder = None
        if image_dim is not None:
            self.image_embedder = WanImageEmbedding(
                image_dim, dim, pos_embed_seq_len, dtype, f"{prefix}.image_embedder"
            )

    def time_forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``timestep`` ``(N,)`` -> ``temb`` ``(N, dim)`` in ``dtype`` and ``timestep_proj`` ``(N, 6 * dim)``.

        The text (``text_embedder``) and image (``image_embedder``) projections are called directly.
        """
        features = timestep_sinusoid(timestep, self.freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        temb = self.time_embedder(features).to(dtype)
        return temb, linear_out(self.time_proj, F.silu(temb))
