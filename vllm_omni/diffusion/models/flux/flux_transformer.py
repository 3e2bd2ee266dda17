"""Flux denoiser (FLUX.1-dev / -schnell / -Kontext) built from vLLM tensor-parallel linear layers.

Same maths and parameter names as diffusers' ``FluxTransformer2DModel``
(``diffusers/models/transformers/transformer_flux.py``), which is the reference:

* packed latents ``(B, N, in_channels)`` (2x2 patches of the 16-channel VAE latent) go through
  ``x_embedder``; T5 features ``(B, L, joint_attention_dim)`` through ``context_embedder``.
* the conditioning vector ``temb`` (``(B, dim)``) is ``timestep_embedder(sinusoid(1000 t))`` plus,
  with ``guidance_embeds`` (FLUX.1-dev, Kontext), ``guidance_embedder(sinusoid(1000 g))`` plus
  ``text_embedder(pooled CLIP output)`` (each: linear, SiLU, linear; 256-channel sinusoid, cos first).
* ``transformer_blocks`` (double stream): per stream an ``AdaLayerNormZero`` (``norm1.linear`` /
  ``norm1_context.linear``: SiLU, linear to ``6 dim`` = shift/scale/gate for attention and MLP),
  joint attention over ``[text, image]`` (each stream's q/k/v packed: ``attn.to_qkv`` /
  ``attn.add_qkv``; per-head RMS q/k norms, eps 1e-6; 3-axis RoPE), ``attn.to_out.0`` /
  ``attn.to_add_out``, gated residuals, and a GELU-tanh MLP per stream (``ff`` / ``ff_context``:
  ``net.0.proj`` to ``4 dim``, ``net.2`` back).
* ``single_transformer_blocks``: one stream ``[text, image]``; ``norm.linear`` (SiLU, linear to
  ``3 dim``: shift/scale/gate), attention (``attn.to_qkv``, RMS q/k norms, RoPE, no output
  projection) beside an MLP branch (``proj_mlp`` to ``4 dim``, GELU-tanh), both concatenated into
  ``proj_out`` (``5 dim -> dim``), gated residual. (BFL's fused ``linear1`` is diffusers'
  ``to_q/to_k/to_v/proj_mlp``; its ``linear2`` is ``proj_out``.)
* ``norm_out`` (``AdaLayerNormContinuous``: LayerNorm times ``1 + scale`` plus ``shift``, scale
  first in ``norm_out.linear``'s output) and ``proj_out`` give ``(B, N, out_channels)``.

RoPE: every token has 3 position ids (``txt_ids``: zeros; ``img_ids``: ``(0, row, col)``, Kontext's
condition image ``(1, row, col)``); axis ``i`` rotates ``axes_dims_rope[i]`` channels of each head by
``pos * theta^(-2j/d)`` (theta 10000, angles in float64, adjacent channel pairs).

Tensor parallelism: every q/k/v (packed, heads sharded), the MLP inputs (``ff.net.0.proj``,
``ff_context.net.0.proj``, ``proj_mlp``) and the modulation linears (``norm1.linear``,
``norm1_context.linear``, ``norm.linear``; output gathered) are column-parallel; ``to_out.0``,
``to_add_out``, ``net.2`` and the single blocks' ``proj_out`` are row-parallel (all-reduce). A single
block's ``proj_out`` reads ``[attention, MLP]``, whose column-parallel shards are not one contiguous
range per rank, so with TP > 1 both branches are all-gathered and each rank takes its contiguous input
range (one extra all-gather of ``5 dim`` per token and single block). Embedders, ``norm_out.linear``
and ``proj_out`` are replicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from vllm_omni.diffusion.distributed.parallel_state import get_tp_rank_and_size
from vllm_omni.diffusion.models.layers import RMSNorm, linear_out, timestep_sinusoid
from vllm_omni.diffusion.models.weight_loading import PretrainedDenoiser
from vllm_omni.errors import ConfigError

EPS = 1e-6
ROPE_THETA = 10000
MLP_RATIO = 4

Rotary = tuple[torch.Tensor, torch.Tensor]


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=EPS)


def rope_tables(ids: torch.Tensor, axes_dim: Sequence[int], theta: int = ROPE_THETA) -> Rotary:
    """``(cos, sin)`` ``(L, sum(axes_dim))`` float32 for position ids ``(L, n_axes)``: per axis the
    angles ``pos * theta^(-2j/d)`` (float64), each repeated for its adjacent channel pair (diffusers'
    ``FluxPosEmbed``)."""
    pos = ids.float()
    cos, sin = [], []
    for axis, dim in enumerate(axes_dim):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim))
        angles = torch.outer(pos[:, axis], freqs)
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def apply_rope(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotate adjacent channel pairs of ``x`` ``(B, L, H, D)`` by ``rotary`` ``(L, D)`` cos/sin tables."""
    cos, sin = (t[None, :, None, :] for t in rotary)
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _qkv(dim: int, heads: int, head_dim: int, dtype: torch.dtype, prefix: str) -> QKVParallelLinear:
    return QKVParallelLinear(dim, head_dim, heads, heads, bias=True, params_dtype=dtype, prefix=prefix)


def _modulation(dim: int, chunks: int, dtype: torch.dtype, prefix: str) -> ColumnParallelLinear:
    return ColumnParallelLinear(
        dim, chunks * dim, bias=True, gather_output=True, params_dtype=dtype, prefix=prefix
    )


def _local_heads(heads: int) -> int:
    _, tp_size = get_tp_rank_and_size()
    if heads % tp_size:
        raise ConfigError(f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp_size}")
    return heads // tp_size


class _Heads(nn.Module):
    """q/k/v of one stream: the packed projection and its per-head RMS norms."""

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.local_heads, self.head_dim = _local_heads(heads), head_dim

    def split(self, layer, q_norm, k_norm, x: torch.Tensor):
        q, k, v = linear_out(layer, x).unflatten(-1, (3 * self.local_heads, self.head_dim)).chunk(3, dim=2)
        return q_norm(q), k_norm(k), v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """RoPE on ``q``/``k`` ``(B, L, H, D)`` and unmasked attention; ``(B, L, H * D)`` in ``q``'s dtype."""
    q, k = apply_rope(q, rotary), apply_rope(k, rotary)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2).to(q.dtype)


class FluxJointAttention(_Heads):
    """Double-stream joint attention; each stream's q/k/v packed into one ``QKVParallelLinear``."""

    def __init__(self, dim: int, heads: int, head_dim: int, dtype: torch.dtype, prefix: str):
        super().__init__(heads, head_dim, dtype)
        inner = heads * head_dim
        self.to_qkv = _qkv(dim, heads, head_dim, dtype, f"{prefix}.to_qkv")
        self.add_qkv = _qkv(dim, heads, head_dim, dtype, f"{prefix}.add_qkv")
        self.norm_q, self.norm_k = RMSNorm(head_dim, EPS, dtype), RMSNorm(head_dim, EPS, dtype)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim, EPS, dtype), RMSNorm(head_dim, EPS, dtype)
        row = dict(bias=True, params_dtype=dtype)
        self.to_out = nn.ModuleList([RowParallelLinear(inner, dim, prefix=f"{prefix}.to_out.0", **row)])
        self.to_add_out = RowParallelLinear(inner, dim, prefix=f"{prefix}.to_add_out", **row)

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``img`` ``(B, N, dim)``, ``txt`` ``(B, L, dim)``, ``rotary`` over ``L + N`` tokens (text
        first); returns both streams' attention outputs, same shapes."""
        iq, ik, iv = self.split(self.to_qkv, self.norm_q, self.norm_k, img)
        tq, tk, tv = self.split(self.add_qkv, self.norm_added_q, self.norm_added_k, txt)
        joint = _attend(torch.cat([tq, iq], 1), torch.cat([tk, ik], 1), torch.cat([tv, iv], 1), rotary)
        seq_txt = txt.shape[1]
        img_out = linear_out(self.to_out[0], joint[:, seq_txt:].contiguous())
        return img_out, linear_out(self.to_add_out, joint[:, :seq_txt].contiguous())


class _GeluProj(nn.Module):
    """diffusers' ``GELU`` activation module: ``gelu_tanh(proj(x))`` with a column-parallel ``proj``."""

    def __init__(self, dim: int, hidden: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.proj = ColumnParallelLinear(dim, hidden, bias=True, params_dtype=dtype, prefix=f"{prefix}.proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(linear_out(self.proj, x), approximate="tanh")


class FluxFeedForward(nn.Module):
    """``net.2(gelu_tanh(net.0.proj(x)))``, hidden ``4 dim`` (``net.1`` is diffusers' dropout)."""

    def __init__(self, dim: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.net = nn.ModuleList(
            [
                _GeluProj(dim, MLP_RATIO * dim, dtype, f"{prefix}.net.0"),
                nn.Identity(),
                RowParallelLinear(
                    MLP_RATIO * dim, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.net.2"
                ),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_out(self.net[2], self.net[0](x))


class _AdaNorm(nn.Module):
    """``norm1`` / ``norm1_context`` / ``norm``: holds ``linear`` (SiLU of ``temb`` -> ``chunks * dim``)."""

    def __init__(self, dim: int, chunks: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.chunks = chunks
        self.linear = _modulation(dim, chunks, dtype, f"{prefix}.linear")

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``chunks`` tensors ``(B, 1, dim)`` (shift, scale, gate, ...), in diffusers' order."""
        return linear_out(self.linear, F.silu(temb)).unsqueeze(1).chunk(self.chunks, dim=-1)


class FluxTransformerBlock(nn.Module):
    """One double-stream block (diffusers' ``FluxTransformerBlock``)."""

    def __init__(self, dim: int, heads: int, head_dim: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.norm1 = _AdaNorm(dim, 6, dtype, f"{prefix}.norm1")
        self.norm1_context = _AdaNorm(dim, 6, dtype, f"{prefix}.norm1_context")
        self.attn = FluxJointAttention(dim, heads, head_dim, dtype, f"{prefix}.attn")
        self.ff = FluxFeedForward(dim, dtype, f"{prefix}.ff")
        self.ff_context = FluxFeedForward(dim, dtype, f"{prefix}.ff_context")

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``img`` ``(B, N, dim)``, ``txt`` ``(B, L, dim)``, ``temb`` ``(B, dim)``, RoPE tables ``(L + N, D)``
        (plain tensors, so the block compiles as a region); new ``(img, txt)``."""
        rotary = (cos, sin)
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(temb)
        c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(temb)
        img_attn, txt_attn = self.attn(
            _layer_norm(img) * (1 + scale) + shift, _layer_norm(txt) * (1 + c_scale) + c_shift, rotary
        )
        img = img + gate * img_attn
        img = img + gate_mlp * self.ff(_layer_norm(img) * (1 + scale_mlp) + shift_mlp)
        txt = txt + c_gate * txt_attn
        txt = txt + c_gate_mlp * self.ff_context(_layer_norm(txt) * (1 + c_scale_mlp) + c_shift_mlp)
        if txt.dtype == torch.float16:  # as diffusers: keep float16 finite
            txt = txt.clip(-65504, 65504)
        return img, txt


class _SingleAttention(_Heads):
    """A single block's attention: packed ``to_qkv`` and RMS q/k norms, no output projection."""

    def __init__(self, dim: int, heads: int, head_dim: int, dtype: torch.dtype, prefix: str):
        super().__init__(heads, head_dim, dtype)
        self.to_qkv = _qkv(dim, heads, head_dim, dtype, f"{prefix}.to_qkv")
        self.norm_q, self.norm_k = RMSNorm(head_dim, EPS, dtype), RMSNorm(head_dim, EPS, dtype)

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        return _attend(*self.split(self.to_qkv, self.norm_q, self.norm_k, x), rotary)


class FluxSingleTransformerBlock(nn.Module):
    """One single-stream block (diffusers' ``FluxSingleTransformerBlock``)."""

    def __init__(self, dim: int, heads: int, head_dim: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_and_size()
        hidden = MLP_RATIO * dim
        self.norm = _AdaNorm(dim, 3, dtype, f"{prefix}.norm")
        self.proj_mlp = ColumnParallelLinear(
            dim, hidden, bias=True, params_dtype=dtype, prefix=f"{prefix}.proj_mlp"
        )
        self.proj_out = RowParallelLinear(
            dim + hidden, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.proj_out"
        )
        self.attn = _SingleAttention(dim, heads, head_dim, dtype, f"{prefix}.attn")

    def _proj_in(self, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        """``proj_out``'s input on this rank: ``[attention, MLP]`` (its contiguous range under TP)."""
        if self.tp_size == 1:
            return torch.cat([attn, mlp], dim=-1)
        from vllm.distributed import tensor_model_parallel_all_gather

        full = torch.cat(
            [
                tensor_model_parallel_all_gather(attn.contiguous()),
                tensor_model_parallel_all_gather(mlp.contiguous()),
            ],
            dim=-1,
        )
        return full.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()

    def forward(
        self, x: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """``x`` ``(B, L + N, dim)`` (text then image tokens), ``temb`` ``(B, dim)``, RoPE tables
        ``(L + N, D)``; same shape out."""
        rotary = (cos, sin)
        shift, scale, gate = self.norm(temb)
        normed = _layer_norm(x) * (1 + scale) + shift
        mlp = F.gelu(linear_out(self.proj_mlp, normed), approximate="tanh")
        out = x + gate * linear_out(self.proj_out, self._proj_in(self.attn(normed, rotary), mlp))
        return out.clip(-65504, 65504) if out.dtype == torch.float16 else out


class _Mlp2(nn.Module):
    """diffusers' ``TimestepEmbedding`` / ``PixArtAlphaTextProjection``: ``linear_2(silu(linear_1(x)))``."""

    def __init__(self, d_in: int, dim: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.linear_1 = ReplicatedLinear(
            d_in, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.linear_1"
        )
        self.linear_2 = ReplicatedLinear(dim, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.linear_2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_out(self.linear_2, F.silu(linear_out(self.linear_1, x)))


class _TimeTextEmbed(nn.Module):
    """``temb = timestep_embedder(t) [+ guidance_embedder(g)] + text_embedder(pooled)``."""

    def __init__(self, dim: int, pooled_dim: int, guidance: bool, dtype: torch.dtype):
        super().__init__()
        prefix = "time_text_embed"
        self.timestep_embedder = _Mlp2(256, dim, dtype, f"{prefix}.timestep_embedder")
        self.guidance_embedder = _Mlp2(256, dim, dtype, f"{prefix}.guidance_embedder") if guidance else None
        self.text_embedder = _Mlp2(pooled_dim, dim, dtype, f"{prefix}.text_embedder")

    @staticmethod
    def _sinusoid(t: torch.Tensor) -> torch.Tensor:
        return timestep_sinusoid(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)

    def forward(
        self, timestep: torch.Tensor, guidance: torch.Tensor | None, pooled: torch.Tensor
    ) -> torch.Tensor:
        temb = self.timestep_embedder(self._sinusoid(timestep).to(pooled.dtype))
        if self.guidance_embedder is not None:
            temb = temb + self.guidance_embedder(self._sinusoid(guidance).to(pooled.dtype))
        return temb + self.text_embedder(pooled)


class _NormOut(nn.Module):
    """diffusers' ``AdaLayerNormContinuous`` (no affine): ``LN(x) * (1 + scale) + shift``."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.linear = ReplicatedLinear(dim, 2 * dim, bias=True, params_dtype=dtype, prefix="norm_out.linear")

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = linear_out(self.linear, F.silu(temb).to(x.dtype)).chunk(2, dim=1)
        return _layer_norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


#: ``config.json`` keys of diffusers' ``FluxTransformer2DModel`` this model reads.
CONFIG_KEYS = (
    "patch_size",
    "in_channels",
    "out_channels",
    "num_layers",
    "num_single_layers",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "pooled_projection_dim",
    "guidance_embeds",
    "axes_dims_rope",
)


class FluxTransformer2DModel(PretrainedDenoiser):
    """Flux denoiser (diffusers ``FluxTransformer2DModel`` checkpoint layout) on vLLM layers.

    Construct after :func:`~vllm_omni.diffusion.distributed.parallel_state.init_diffusion_parallel_state`
    under ``current_vllm_config_for_layers()``; :meth:`from_pretrained` does both the context and the
    loading. Constructor arguments are the diffusers ``config.json`` fields plus ``dtype``.

    Patchable linear layers (``{d}`` = ``transformer_blocks.i``, ``{s}`` = ``single_transformer_blocks.j``):
    ``{d}.attn.to_qkv`` / ``{d}.attn.add_qkv`` / ``{s}.attn.to_qkv`` (QKVParallelLinear packing
    ``to_q/to_k/to_v`` and ``add_q_proj/add_k_proj/add_v_proj``), ``{d}.attn.to_out.0``,
    ``{d}.attn.to_add_out``, ``{d}.ff{,_context}.net.2``, ``{s}.proj_out`` (RowParallelLinear),
    ``{d}.ff{,_context}.net.0.proj``, ``{d}.norm1{,_context}.linear``, ``{s}.norm.linear``, ``{s}.proj_mlp``
    (ColumnParallelLinear), ``x_embedder``, ``context_embedder``, ``proj_out``, ``norm_out.linear``,
    ``time_text_embed.{timestep,guidance,text}_embedder.linear_{1,2}`` (ReplicatedLinear): the diffusers
    module names, so diffusers / PEFT adapters bind unchanged.

    Raises:
        ConfigError: a config key this model does not know (named), ``patch_size != 1``,
            ``sum(axes_dims_rope) != attention_head_dim``, or heads not divisible by the TP size.
    """

    _repeated_blocks = ("FluxTransformerBlock", "FluxSingleTransformerBlock")

    #: ``(packed_param, checkpoint_sub_module, shard_id)``: which checkpoint projections share one
    #: packed vLLM layer (read by weight loading and by the LoRA manager).
    stacked_params_mapping: list[tuple[str, str, str | int]] = [
        ("to_qkv", "to_q", "q"),
        ("to_qkv", "to_k", "k"),
        ("to_qkv", "to_v", "v"),
        ("add_qkv", "add_q_proj", "q"),
        ("add_qkv", "add_k_proj", "k"),
        ("add_qkv", "add_v_proj", "v"),
    ]

    def __init__(
        self,
        patch_size: int = 1,
        in_channels: int = 64,
        out_channels: int | None = None,
        num_layers: int = 19,
        num_single_layers: int = 38,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 4096,
        pooled_projection_dim: int = 768,
        guidance_embeds: bool = False,
        axes_dims_rope: Sequence[int] = (16, 56, 56),
        dtype: torch.dtype = torch.float32,
        **unknown,
    ):
        super().__init__()
        if unknown:
            raise ConfigError(
                f"transformer config keys {sorted(unknown)} are not FluxTransformer2DModel fields served in-tree "
                f"(known: {list(CONFIG_KEYS)}); run the stage with pipeline_backend='diffusers'"
            )
        if patch_size != 1:
            raise ConfigError(
                f"transformer config patch_size={patch_size}: the in-tree Flux serves patch_size 1"
            )
        if sum(axes_dims_rope) != attention_head_dim or any(d % 2 for d in axes_dims_rope):
            raise ConfigError(
                f"axes_dims_rope={list(axes_dims_rope)} must be even and sum to attention_head_dim={attention_head_dim}"
            )
        self.in_channels = in_channels
        self.out_channels = out_channels or in_channels
        self.guidance_embeds = bool(guidance_embeds)
        self.axes_dims_rope = [int(d) for d in axes_dims_rope]
        self.inner_dim = dim = num_attention_heads * attention_head_dim
        self._dtype = dtype
        self.time_text_embed = _TimeTextEmbed(dim, pooled_projection_dim, self.guidance_embeds, dtype)
        self.context_embedder = ReplicatedLinear(
            joint_attention_dim, dim, bias=True, params_dtype=dtype, prefix="context_embedder"
        )
        self.x_embedder = ReplicatedLinear(
            in_channels, dim, bias=True, params_dtype=dtype, prefix="x_embedder"
        )
        heads, head_dim = num_attention_heads, attention_head_dim
        self.transformer_blocks = nn.ModuleList(
            FluxTransformerBlock(dim, heads, head_dim, dtype, f"transformer_blocks.{i}")
            for i in range(num_layers)
        )
        self.single_transformer_blocks = nn.ModuleList(
            FluxSingleTransformerBlock(dim, heads, head_dim, dtype, f"single_transformer_blocks.{i}")
            for i in range(num_single_layers)
        )
        self.norm_out = _NormOut(dim, dtype)
        self.proj_out = ReplicatedLinear(
            dim, self.out_channels, bias=True, params_dtype=dtype, prefix="proj_out"
        )

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype the model was built with."""
        return self._dtype

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow for packed latents (diffusers' forward arguments, same meaning).

        Args:
            hidden_states: ``(B, N, in_channels)`` packed latent patches (Kontext: output then
                condition-image tokens).
            encoder_hidden_states: ``(B, L, joint_attention_dim)`` T5 features.
            pooled_projections: ``(B, pooled_projection_dim)`` pooled CLIP output.
            timestep: ``(B,)`` in ``[0, 1]`` (the scheduler's timestep / 1000).
            img_ids: ``(N, 3)`` position ids of the image tokens. txt_ids: ``(L, 3)`` (zeros).
            guidance: ``(B,)`` distilled guidance scale; required iff ``guidance_embeds``.

        Returns:
            ``(B, N, out_channels)`` in the model dtype.

        Raises:
            ValueError: ``guidance`` missing for a guidance-distilled model, or mismatched sizes.
        """
        batch = hidden_states.shape[0]
        if self.guidance_embeds and guidance is None:
            raise ValueError("this Flux transformer has guidance_embeds: pass guidance (B,)")
        if img_ids.shape[0] != hidden_states.shape[1] or txt_ids.shape[0] != encoder_hidden_states.shape[1]:
            raise ValueError(
                f"position ids do not match the tokens: img_ids {tuple(img_ids.shape)} for {hidden_states.shape[1]} "
                f"image tokens, txt_ids {tuple(txt_ids.shape)} for {encoder_hidden_states.shape[1]} text tokens"
            )
        if encoder_hidden_states.shape[0] != batch or timestep.shape[0] != batch:
            raise ValueError(
                f"batch mismatch: {batch} latents, {encoder_hidden_states.shape[0]} texts, {timestep.shape[0]} timesteps"
            )
        img = linear_out(self.x_embedder, hidden_states.to(self._dtype))
        t = timestep.to(img.dtype) * 1000
        g = guidance.to(img.dtype) * 1000 if self.guidance_embeds else None
        temb = self.time_text_embed(t, g, pooled_projections.to(self._dtype))
        txt = linear_out(self.context_embedder, encoder_hidden_states.to(self._dtype))
        rotary = rope_tables(torch.cat([txt_ids, img_ids], dim=0), self.axes_dims_rope)
        for block in self.transformer_blocks:
            img, txt = block(img, txt, temb, *rotary)
        seq_txt = txt.shape[1]
        x = torch.cat([txt, img], dim=1)
        for block in self.single_transformer_blocks:
            x = block(x, temb, *rotary)
        return linear_out(self.proj_out, self.norm_out(x[:, seq_txt:], temb))
