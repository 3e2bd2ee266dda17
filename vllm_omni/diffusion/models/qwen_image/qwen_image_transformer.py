"""Qwen-Image dual-stream MMDiT denoiser built from vLLM tensor-parallel linear layers.

Same maths and parameter names as diffusers' ``QwenImageTransformer2DModel``
(``diffusers/models/transformers/transformer_qwenimage.py``), which is the reference:

* packed image latents ``(B, N, in_channels)`` (2x2 patches of the 16-channel VAE latent) go
  through ``img_in``; the text encoder's last hidden states ``(B, L, joint_attention_dim)`` through
  ``txt_norm`` (RMS) and ``txt_in``.
* the timestep (``t`` in ``[0, 1]``, scaled by 1000 inside) becomes ``temb`` through a 256-channel
  sinusoid (cos first) and ``time_text_embed.timestep_embedder`` (linear, SiLU, linear).
* each of ``transformer_blocks`` keeps two streams. Per stream, ``{img,txt}_mod`` (SiLU, linear to
  ``6 * dim``) gives shift/scale/gate for two LayerNorm (no affine, eps 1e-6) + modulate steps:
  ``x * (1 + scale) + shift``. Joint attention: each stream's q/k/v (``attn.to_qkv`` for the image,
  ``attn.add_qkv`` for the text), per-head RMS q/k norms, 3-axis RoPE, one attention over
  ``[text, image]`` tokens (text padding masked as keys), then ``attn.to_out.0`` / ``attn.to_add_out``.
  Residuals are gated; the MLPs are ``net.0.proj`` (GELU, tanh approximation) and ``net.2``.
* ``norm_out`` (LayerNorm scaled by ``1 + scale`` and shifted, from ``linear(silu(temb))``) and
  ``proj_out`` produce ``(B, N, patch_size**2 * out_channels)``.

RoPE (``QwenEmbedRope`` with ``scale_rope=True``, theta 10000): an image of ``(F, H, W)`` patches
takes frame positions ``idx .. idx+F-1`` (``idx``: its index in the sample's image list) and
centred row/column positions ``-(H - H//2) .. H//2 - 1``; text tokens take position
``max(H//2, W//2) + j`` on all three axes.

Tensor parallelism: ``attn.to_qkv`` / ``attn.add_qkv`` (packed q/k/v, heads sharded) and the MLP
``net.0.proj`` are column-parallel; ``attn.to_out.0``, ``attn.to_add_out`` and the MLP ``net.2``
row-parallel (all-reduce); the modulation layers ``{img,txt}_mod.1`` are column-parallel with a
gathered output (their weights are a third of the model: sharding them divides that memory too).
Embedders, ``norm_out.linear`` and ``proj_out`` are replicated.
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
#: positions diffusers' rotary tables hold per axis (``QwenEmbedRope``: ``torch.arange(4096)``).
ROPE_POSITIONS = 4096

ImageShapes = Sequence[Sequence[tuple[int, int, int]]]


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=EPS)


class QwenRope:
    """Complex rotations of the 3-axis RoPE, computed on demand and cached per shape.

    ``__call__(shapes, txt_len, device)`` -> ``(img_freqs (N, D/2), txt_freqs (txt_len, D/2))``,
    complex64, where ``shapes`` lists one sample's images as ``(F, H, W)`` in patches and
    ``N = sum(F*H*W)``.
    """

    def __init__(self, axes_dim: Sequence[int], theta: int = ROPE_THETA):
        if any(d % 2 for d in axes_dim):
            raise ConfigError(f"axes_dims_rope must be even, got {list(axes_dim)}")
        self.axes_dim = [int(d) for d in axes_dim]
        self.inv = [1.0 / torch.pow(theta, torch.arange(0, d, 2).to(torch.float32).div(d)) for d in axes_dim]
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _axis(self, axis: int, start: int, stop: int) -> torch.Tensor:
        angles = torch.outer(torch.arange(start, stop), self.inv[axis])
        return torch.polar(torch.ones_like(angles), angles)

    def _image(self, frame: int, height: int, width: int, idx: int) -> torch.Tensor:
        f = self._axis(0, idx, idx + frame).view(frame, 1, 1, -1).expand(frame, height, width, -1)
        h = self._axis(1, -(height - height // 2), height // 2).view(1, height, 1, -1)
        w = self._axis(2, -(width - width // 2), width // 2).view(1, 1, width, -1)
        h, w = h.expand(frame, height, width, -1), w.expand(frame, height, width, -1)
        return torch.cat([f, h, w], dim=-1).reshape(frame * height * width, -1)

    def __call__(
        self, shapes: Sequence[tuple[int, int, int]], txt_len: int, device
    ) -> tuple[torch.Tensor, ...]:
        key = (tuple(tuple(int(v) for v in s) for s in shapes), int(txt_len), str(device))
        if key not in self._cache:
            img = torch.cat([self._image(*s, idx) for idx, s in enumerate(key[0])])
            start = max(max(h // 2, w // 2) for _, h, w in key[0])
            if start + txt_len > ROPE_POSITIONS:
                raise ValueError(
                    f"{txt_len} text tokens after image position {start} exceed the {ROPE_POSITIONS} rotary "
                    "positions of Qwen-Image (a shorter prompt or a smaller image fits)"
                )
            txt = torch.cat([self._axis(a, start, start + txt_len) for a in range(3)], dim=-1)
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = (img.to(device), txt.to(device))
        return self._cache[key]


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of ``x`` ``(B, L, H, D)`` by ``freqs`` ``(L, D/2)`` complex."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs.unsqueeze(1)).flatten(3).type_as(x)


class QwenJointAttention(nn.Module):
    """Joint attention of the two streams; each stream's q/k/v packed into one ``QKVParallelLinear``."""

    def __init__(self, dim: int, heads: int, head_dim: int, dtype: torch.dtype, prefix: str = ""):
        super().__init__()
        _, tp_size = get_tp_rank_and_size()
        if heads % tp_size:
            raise ConfigError(
                f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp_size}"
            )
        self.head_dim = head_dim
        self.local_heads = heads // tp_size
        inner = heads * head_dim

        def qkv(name: str) -> QKVParallelLinear:
            return QKVParallelLinear(
                dim, head_dim, heads, heads, bias=True, params_dtype=dtype, prefix=f"{prefix}.{name}"
            )

        def out(name: str) -> RowParallelLinear:
            return RowParallelLinear(inner, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.{name}")

        self.to_qkv = qkv("to_qkv")
        self.add_qkv = qkv("add_qkv")
        self.norm_q, self.norm_k = RMSNorm(head_dim, EPS, dtype), RMSNorm(head_dim, EPS, dtype)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim, EPS, dtype), RMSNorm(head_dim, EPS, dtype)
        self.to_out = nn.ModuleList([out("to_out.0")])
        self.to_add_out = out("to_add_out")

    def _project(self, layer, q_norm, k_norm, x, freqs):
        q, k, v = linear_out(layer, x).unflatten(-1, (3 * self.local_heads, self.head_dim)).chunk(3, dim=2)
        return _rope(q_norm(q), freqs), _rope(k_norm(k), freqs), v

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        key_mask: torch.Tensor | None,
        img_freqs: torch.Tensor,
        txt_freqs: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``img`` ``(B, N, dim)``, ``txt`` ``(B, L, dim)``, ``key_mask`` ``(B, L + N)`` bool (True =
        attend) or ``None``, rotations ``(N, D/2)`` / ``(L, D/2)`` complex; returns the two streams'
        attention outputs, same shapes."""
        iq, ik, iv = self._project(self.to_qkv, self.norm_q, self.norm_k, img, img_freqs)
        tq, tk, tv = self._project(self.add_qkv, self.norm_added_q, self.norm_added_k, txt, txt_freqs)
        q, k, v = (torch.cat(pair, dim=1).transpose(1, 2) for pair in ((tq, iq), (tk, ik), (tv, iv)))
        mask = key_mask[:, None, None, :] if key_mask is not None else None
        joint = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)
        joint = joint.to(q.dtype)
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


class QwenFeedForward(nn.Module):
    """``net.2(gelu_tanh(net.0.proj(x)))`` with hidden size ``4 * dim`` (``net.1`` is diffusers' dropout)."""

    def __init__(self, dim: int, dtype: torch.dtype, prefix: str = ""):
        super().__init__()
        self.net = nn.ModuleList(
            [
                _GeluProj(dim, 4 * dim, dtype, f"{prefix}.net.0"),
                nn.Identity(),
                RowParallelLinear(4 * dim, dim, bias=True, params_dtype=dtype, prefix=f"{prefix}.net.2"),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_out(self.net[2], self.net[0](x))


class QwenImageTransformerBlock(nn.Module):
    """One dual-stream block: modulated norms, joint attention and an MLP per stream."""

    def __init__(self, dim: int, heads: int, head_dim: int, dtype: torch.dtype, prefix: str = ""):
        super().__init__()

        def mod(name: str) -> nn.ModuleList:
            return nn.ModuleList(
                [
                    nn.SiLU(),
                    ColumnParallelLinear(
                        dim,
                        6 * dim,
                        bias=True,
                        gather_output=True,
                        params_dtype=dtype,
                        prefix=f"{prefix}.{name}.1",
                    ),
                ]
            )

        self.img_mod = mod("img_mod")
        self.txt_mod = mod("txt_mod")
        self.attn = QwenJointAttention(dim, heads, head_dim, dtype, prefix=f"{prefix}.attn")
        self.img_mlp = QwenFeedForward(dim, dtype, prefix=f"{prefix}.img_mlp")
        self.txt_mlp = QwenFeedForward(dim, dtype, prefix=f"{prefix}.txt_mlp")

    @staticmethod
    def _modulate(x: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale, gate = params.unsqueeze(1).chunk(3, dim=-1)
        return _layer_norm(x) * (1 + scale) + shift, gate

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        key_mask: torch.Tensor | None,
        temb: torch.Tensor,
        img_freqs: torch.Tensor,
        txt_freqs: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``img`` ``(B, N, dim)``, ``txt`` ``(B, L, dim)``, ``temb`` ``(B, dim)``, RoPE rotations of each
        stream (plain tensors, so the block compiles as a region); returns new ``(img, txt)``."""
        img_mod1, img_mod2 = linear_out(self.img_mod[1], self.img_mod[0](temb)).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = linear_out(self.txt_mod[1], self.txt_mod[0](temb)).chunk(2, dim=-1)
        img_in, img_gate = self._modulate(img, img_mod1)
        txt_in, txt_gate = self._modulate(txt, txt_mod1)
        img_attn, txt_attn = self.attn(img_in, txt_in, key_mask, img_freqs, txt_freqs)
        img = img + img_gate * img_attn
        txt = txt + txt_gate * txt_attn
        img_in, img_gate = self._modulate(img, img_mod2)
        img = img + img_gate * self.img_mlp(img_in)
        txt_in, txt_gate = self._modulate(txt, txt_mod2)
        txt = txt + txt_gate * self.txt_mlp(txt_in)
        if txt.dtype == torch.float16:  # as diffusers: keep float16 finite
            txt, img = txt.clip(-65504, 65504), img.clip(-65504, 65504)
        return img, txt


class _TimestepEmbedder(nn.Module):
    """diffusers' ``TimestepEmbedding``: ``linear_2(silu(linear_1(x)))``, replicated layers."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.linear_1 = ReplicatedLinear(
            256, dim, bias=True, params_dtype=dtype, prefix="time_text_embed.timestep_embedder.linear_1"
        )
        self.linear_2 = ReplicatedLinear(
            dim, dim, bias=True, params_dtype=dtype, prefix="time_text_embed.timestep_embedder.linear_2"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_out(self.linear_2, F.silu(linear_out(self.linear_1, x)))


class _TimeTextEmbed(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.timestep_embedder = _TimestepEmbedder(dim, dtype)


class _NormOut(nn.Module):
    """diffusers' ``AdaLayerNormContinuous`` (no affine): ``LN(x) * (1 + scale) + shift``."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.linear = ReplicatedLinear(dim, 2 * dim, bias=True, params_dtype=dtype, prefix="norm_out.linear")

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = linear_out(self.linear, F.silu(temb).to(x.dtype)).chunk(2, dim=1)
        return _layer_norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


_UNSUPPORTED = {
    "zero_cond_t": "Qwen-Image-Edit-2511's zero-timestep condition",
    "use_additional_t_cond": "the additional timestep condition",
    "use_layer3d_rope": "Qwen-Image-Layered's layer RoPE",
    "guidance_embeds": "guidance embeddings",
}


class QwenImageTransformer2DModel(PretrainedDenoiser):
    """Qwen-Image denoiser (diffusers ``QwenImageTransformer2DModel`` checkpoint layout) on vLLM layers.

    Construct after :func:`~vllm_omni.diffusion.distributed.parallel_state.init_diffusion_parallel_state`
    under ``current_vllm_config_for_layers()``; :meth:`from_pretrained` does both the context and the
    loading. Constructor arguments are the diffusers ``config.json`` fields plus ``dtype``.

    Patchable linear layers (``{b}`` = ``transformer_blocks.i``): ``{b}.attn.to_qkv`` and
    ``{b}.attn.add_qkv`` (QKVParallelLinear packing ``to_q/to_k/to_v`` and
    ``add_q_proj/add_k_proj/add_v_proj``), ``{b}.attn.to_out.0``, ``{b}.attn.to_add_out``,
    ``{b}.{img,txt}_mlp.net.2`` (RowParallelLinear), ``{b}.{img,txt}_mlp.net.0.proj``,
    ``{b}.{img,txt}_mod.1`` (ColumnParallelLinear), ``img_in``, ``txt_in``, ``proj_out``,
    ``norm_out.linear``, ``time_text_embed.timestep_embedder.linear_{1,2}`` (ReplicatedLinear).

    Raises:
        ConfigError: a variant this model does not implement (``zero_cond_t``,
            ``use_additional_t_cond``, ``use_layer3d_rope``, ``guidance_embeds``), or heads not
            divisible by the tensor-parallel size.
    """

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
        patch_size: int = 2,
        in_channels: int = 64,
        out_channels: int | None = 16,
        num_layers: int = 60,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 3584,
        axes_dims_rope: Sequence[int] = (16, 56, 56),
        dtype: torch.dtype = torch.float32,
        **variants,
    ):
        super().__init__()
        for key, value in variants.items():
            if key in _UNSUPPORTED and value:
                raise ConfigError(
                    f"transformer config sets {key}={value!r} ({_UNSUPPORTED[key]}): not implemented in-tree"
                )
        if sum(axes_dims_rope) != attention_head_dim:
            raise ConfigError(
                f"sum(axes_dims_rope)={sum(axes_dims_rope)} must equal attention_head_dim={attention_head_dim}"
            )
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_channels = out_channels or in_channels
        self.inner_dim = dim = num_attention_heads * attention_head_dim
        self._dtype = dtype
        self.pos_embed = QwenRope(axes_dims_rope)
        self.time_text_embed = _TimeTextEmbed(dim, dtype)
        self.txt_norm = RMSNorm(joint_attention_dim, EPS, dtype)
        self.img_in = ReplicatedLinear(in_channels, dim, bias=True, params_dtype=dtype, prefix="img_in")
        self.txt_in = ReplicatedLinear(
            joint_attention_dim, dim, bias=True, params_dtype=dtype, prefix="txt_in"
        )
        self.transformer_blocks = nn.ModuleList(
            QwenImageTransformerBlock(
                dim, num_attention_heads, attention_head_dim, dtype, f"transformer_blocks.{i}"
            )
            for i in range(num_layers)
        )
        self.norm_out = _NormOut(dim, dtype)
        out = patch_size * patch_size * self.out_channels
        self.proj_out = ReplicatedLinear(dim, out, bias=True, params_dtype=dtype, prefix="proj_out")

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype the model was built with."""
        return self._dtype

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        img_shapes: ImageShapes,
    ) -> torch.Tensor:
        """Predict the flow for packed latents (the arguments of diffusers' forward, same meaning).

        Args:
            hidden_states: ``(B, N, in_channels)`` packed latent patches (all images of a sample,
                in ``img_shapes`` order).
            encoder_hidden_states: ``(B, L, joint_attention_dim)`` text features, padded.
            encoder_hidden_states_mask: ``(B, L)`` (True/1 = real token) or ``None`` (no padding).
            timestep: ``(B,)`` in ``[0, 1]`` (the scheduler's timestep / 1000).
            img_shapes: per sample, its images as ``(F, H, W)`` in patches; every sample must have
                the same shapes (one RoPE table for the batch, as in diffusers).

        Returns:
            ``(B, N, patch_size**2 * out_channels)`` in the model dtype.

        Raises:
            ValueError: samples with different ``img_shapes``, or mismatched batch sizes.
        """
        batch = hidden_states.shape[0]
        if len({tuple(map(tuple, s)) for s in img_shapes}) != 1:
            raise ValueError(f"every sample of a batch needs the same img_shapes, got {list(img_shapes)}")
        if encoder_hidden_states.shape[0] != batch or timestep.shape[0] != batch:
            raise ValueError(
                f"batch mismatch: {batch} latents, {encoder_hidden_states.shape[0]} texts, {timestep.shape[0]} timesteps"
            )
        img = linear_out(self.img_in, hidden_states.to(self._dtype))
        txt = linear_out(self.txt_in, self.txt_norm(encoder_hidden_states.to(self._dtype)))
        proj = timestep_sinusoid(
            timestep.to(img.dtype), 256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000
        )
        temb = self.time_text_embed.timestep_embedder(proj.to(img.dtype))
        img_freqs, txt_freqs = self.pos_embed(img_shapes[0], txt.shape[1], img.device)
        key_mask = None
        if encoder_hidden_states_mask is not None and not bool(encoder_hidden_states_mask.all()):
            image_keys = torch.ones(img.shape[:2], dtype=torch.bool, device=img.device)
            key_mask = torch.cat([encoder_hidden_states_mask.to(torch.bool), image_keys], dim=1)
        for block in self.transformer_blocks:
            img, txt = block(img, txt, key_mask, temb, img_freqs, txt_freqs)
        return linear_out(self.proj_out, self.norm_out(img, temb))
