"""Z-Image single-stream DiT denoiser built from vLLM tensor-parallel linear layers.

Architecture (same maths and parameter names as the diffusers checkpoint format):

* image latents ``(C, F, H, W)`` are cut into ``p x p`` patches and embedded
  (``all_x_embedder.{p}-{pf}``); caption features ``(L, cap_feat_dim)`` are RMS-normed
  and embedded (``cap_embedder``). Both sequences are padded to a multiple of 32 tokens
  with learned pad tokens (``x_pad_token``, ``cap_pad_token``).
* a timestep MLP (``t_embedder``) drives adaLN modulation of the image tokens.
* ``noise_refiner`` blocks (modulated) refine image tokens, ``context_refiner`` blocks
  (unmodulated) refine caption tokens, then ``layers`` process the joint sequence
  ``[image tokens, caption tokens]`` and ``all_final_layer`` projects image tokens back to
  patches.
* attention uses 3-axis rotary embeddings (frame/caption index, row, column) and
  per-head RMS q/k norms; scaled-dot-product attention from torch.

Tensor parallelism: ``attention.to_qkv`` (packed q/k/v, heads sharded) and
``feed_forward.w13`` (packed w1/w3) are column-parallel, ``attention.to_out.0`` and
``feed_forward.w2`` row-parallel (all-reduce). Embedders, adaLN projections and the final
layer are replicated. Only the basic text-to-image mode is implemented (no SigLIP /
omni inputs, no controlnet residuals).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from vllm_omni.diffusion.distributed.parallel_state import get_tp_rank_and_size
from vllm_omni.diffusion.forward_context import rows_per_sample
from vllm_omni.diffusion.models.layers import RMSNorm
from vllm_omni.diffusion.models.layers import linear_out as _linear
from vllm_omni.diffusion.models.weight_loading import PretrainedDenoiser
from vllm_omni.errors import ConfigError

ADALN_EMBED_DIM = 256
SEQ_MULTI_OF = 32
T_EMBED_MID = 1024
T_FREQ_DIM = 256


class TimestepEmbedder(nn.Module):
    """Sinusoidal timestep features -> MLP. ``forward(t: (B,)) -> (B, out_size)`` in the weight dtype."""

    def __init__(self, out_size: int, dtype: torch.dtype, prefix: str = ""):
        super().__init__()
        self.dtype = dtype
        self.mlp = nn.ModuleList(
            [
                ReplicatedLinear(
                    T_FREQ_DIM, T_EMBED_MID, bias=True, params_dtype=dtype, prefix=f"{prefix}.mlp.0"
                ),
                nn.SiLU(),
                ReplicatedLinear(
                    T_EMBED_MID, out_size, bias=True, params_dtype=dtype, prefix=f"{prefix}.mlp.2"
                ),
            ]
        )

    @staticmethod
    def sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        """``(B,)`` -> ``(B, dim)`` fp32 features ``[cos(t f), sin(t f)]``, f geometric from 1 to 1/max_period."""
        half = dim // 2
        exponent = torch.arange(half, dtype=torch.float32, device=t.device) / half
        freqs = torch.exp(-math.log(max_period) * exponent)
        angles = t.float()[:, None] * freqs[None]
        return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = self.mlp[1](_linear(self.mlp[0], self.sinusoid(t, T_FREQ_DIM).to(self.dtype)))
        return _linear(self.mlp[2], h)


class ZImageAttention(nn.Module):
    """Self-attention with packed, head-sharded ``to_qkv``, q/k RMS norms, RoPE and row-parallel ``to_out.0``."""

    def __init__(self, dim: int, n_heads: int, qk_norm: bool, dtype: torch.dtype, prefix: str = ""):
        super().__init__()
        _, tp_size = get_tp_rank_and_size()
        if n_heads % tp_size:
            raise ConfigError(f"n_heads={n_heads} is not divisible by tensor_parallel_size={tp_size}")
        self.head_dim = dim // n_heads
        self.local_heads = n_heads // tp_size
        self.to_qkv = QKVParallelLinear(
            dim, self.head_dim, n_heads, n_heads, bias=False, params_dtype=dtype, prefix=f"{prefix}.to_qkv"
        )
        self.norm_q = RMSNorm(self.head_dim, 1e-5, dtype) if qk_norm else None
        self.norm_k = RMSNorm(self.head_dim, 1e-5, dtype) if qk_norm else None
        self.to_out = nn.ModuleList(
            [RowParallelLinear(dim, dim, bias=False, params_dtype=dtype, prefix=f"{prefix}.to_out.0")]
        )

    @staticmethod
    def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        # x: (B, L, H, D) real; freqs: (B, L, D/2) complex64; adjacent pairs rotate together.
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs.unsqueeze(2)).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, freqs: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, L, dim)``; ``mask``: ``(B, L)`` bool (True = real token) or ``None``; returns ``(B, L, dim)``."""
        qkv = _linear(self.to_qkv, x)
        q, k, v = qkv.unflatten(-1, (3 * self.local_heads, self.head_dim)).chunk(3, dim=2)
        if self.norm_q is not None:
            q = self.norm_q(q)
            k = self.norm_k(k)
        q, k = self._rope(q, freqs), self._rope(k, freqs)
        attn_mask = mask[:, None, None, :] if mask is not None else None
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask
        )
        out = out.transpose(1, 2).flatten(2).to(x.dtype)
        return _linear(self.to_out[0], out)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)`` with packed column-parallel ``w13`` and row-parallel ``w2``."""

    def __init__(self, dim: int, hidden_dim: int, dtype: torch.dtype, prefix: str = ""):
        super().__init__()
        self.w13 = MergedColumnParallelLinear(
            dim, [hidden_dim, hidden_dim], bias=False, params_dtype=dtype, prefix=f"{prefix}.w13"
        )
        self.w2 = RowParallelLinear(hidden_dim, dim, bias=False, params_dtype=dtype, prefix=f"{prefix}.w2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x3 = _linear(self.w13, x).chunk(2, dim=-1)
        return _linear(self.w2, F.silu(x1) * x3)


class ZImageTransformerBlock(nn.Module):
    """Pre/post-normed attention + FFN block, optionally adaLN-modulated by the timestep embedding."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        norm_eps: float,
        qk_norm: bool,
        modulation: bool,
        dtype,
        prefix: str = "",
    ):
        super().__init__()
        self.attention = ZImageAttention(dim, n_heads, qk_norm, dtype, prefix=f"{prefix}.attention")
        self.feed_forward = FeedForward(dim, int(dim / 3 * 8), dtype, prefix=f"{prefix}.feed_forward")
        self.attention_norm1 = RMSNorm(dim, norm_eps, dtype)
        self.ffn_norm1 = RMSNorm(dim, norm_eps, dtype)
        self.attention_norm2 = RMSNorm(dim, norm_eps, dtype)
        self.ffn_norm2 = RMSNorm(dim, norm_eps, dtype)
        self.modulation = modulation
        if modulation:
            self.adaLN_modulation = nn.ModuleList(
                [
                    ReplicatedLinear(
                        min(dim, ADALN_EMBED_DIM),
                        4 * dim,
                        bias=True,
                        params_dtype=dtype,
                        prefix=f"{prefix}.adaLN_modulation.0",
                    )
                ]
            )

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        freqs: torch.Tensor,
        adaln: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x``: ``(B, L, dim)``; ``adaln``: ``(B, min(dim, 256))`` when modulated; returns ``(B, L, dim)``."""
        if not self.modulation:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), mask, freqs))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        mod = _linear(self.adaLN_modulation[0], adaln).unsqueeze(1)
        scale_msa, gate_msa, scale_mlp, gate_mlp = mod.chunk(4, dim=2)
        attn_out = self.attention(self.attention_norm1(x) * (1.0 + scale_msa), mask, freqs)
        x = x + gate_msa.tanh() * self.attention_norm2(attn_out)
        ffn_out = self.feed_forward(self.ffn_norm1(x) * (1.0 + scale_mlp))
        return x + gate_mlp.tanh() * self.ffn_norm2(ffn_out)


class FinalLayer(nn.Module):
    """LayerNorm (no affine) scaled by ``1 + adaLN(silu(c))``, then projection to patch pixels."""

    def __init__(self, dim: int, out_channels: int, dtype, prefix: str = ""):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = ReplicatedLinear(
            dim, out_channels, bias=True, params_dtype=dtype, prefix=f"{prefix}.linear"
        )
        self.adaLN_modulation = nn.ModuleList(
            [
                nn.SiLU(),
                ReplicatedLinear(
                    min(dim, ADALN_EMBED_DIM),
                    dim,
                    bias=True,
                    params_dtype=dtype,
                    prefix=f"{prefix}.adaLN_modulation.1",
                ),
            ]
        )

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + _linear(self.adaLN_modulation[1], self.adaLN_modulation[0](c))
        return _linear(self.linear, self.norm_final(x) * scale.unsqueeze(1))


class RopeTable:
    """Per-axis complex rotation tables; ``lookup(ids: (N, 3) int) -> (N, sum(axes_dims)/2)`` complex64."""

    def __init__(self, theta: float, axes_dims: list[int], axes_lens: list[int]):
        self.tables = []
        for dim, length in zip(axes_dims, axes_lens, strict=True):
            inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            angles = torch.outer(torch.arange(length, dtype=torch.float64), inv).float()
            self.tables.append(torch.polar(torch.ones_like(angles), angles).to(torch.complex64))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tables[0].device != ids.device:
            self.tables = [t.to(ids.device) for t in self.tables]
        return torch.cat([table[ids[:, axis]] for axis, table in enumerate(self.tables)], dim=-1)


def _grid_ids(size: tuple[int, int, int], start: tuple[int, int, int], device) -> torch.Tensor:
    """All integer coordinates of a 3-D box, row-major: ``(prod(size), 3)`` int32."""
    axes = [
        torch.arange(s0, s0 + n, dtype=torch.int32, device=device) for s0, n in zip(start, size, strict=True)
    ]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).flatten(0, 2)


class ZImageTransformer2DModel(PretrainedDenoiser):
    """Z-Image denoiser (diffusers ``ZImageTransformer2DModel`` checkpoint layout) on vLLM linear layers.

    Construct after :func:`~vllm_omni.diffusion.distributed.parallel_state.init_diffusion_parallel_state`
    has run in this process and under ``current_vllm_config_for_layers()`` (vLLM layers read
    the TP group and a current vLLM config); :meth:`from_pretrained` enters the config
    context itself. Constructor arguments are the diffusers ``config.json`` fields
    (``n_kv_heads`` is accepted and, as in diffusers, unused: attention is full multi-head)
    plus ``dtype`` for all parameters.

    Patchable linear layers (module paths; ``{blk}`` is ``layers.i``, ``noise_refiner.i`` or
    ``context_refiner.i``): ``{blk}.attention.to_qkv`` (QKVParallelLinear, packs
    to_q/to_k/to_v), ``{blk}.attention.to_out.0`` (RowParallelLinear),
    ``{blk}.feed_forward.w13`` (MergedColumnParallelLinear, packs w1/w3),
    ``{blk}.feed_forward.w2`` (RowParallelLinear), ``{layers|noise_refiner}.i.adaLN_modulation.0``,
    ``all_x_embedder.2-1``, ``cap_embedder.1``, ``t_embedder.mlp.0``, ``t_embedder.mlp.2``,
    ``all_final_layer.2-1.linear``, ``all_final_layer.2-1.adaLN_modulation.1`` (ReplicatedLinear).
    Base weights live in each layer's ``weight`` parameter (this rank's shard,
    ``[out_per_rank, in_per_rank]``) as long as ``keep_base_weights=True`` (default).
    """

    #: ``(packed_param, checkpoint_sub_module, shard_id)``. Single source of truth for
    #: which checkpoint projections share one packed vLLM layer (also read by LoRA).
    stacked_params_mapping: list[tuple[str, str, str | int]] = [
        ("to_qkv", "to_q", "q"),
        ("to_qkv", "to_k", "k"),
        ("to_qkv", "to_v", "v"),
        ("w13", "w1", 0),
        ("w13", "w3", 1),
    ]

    def __init__(
        self,
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels: int = 16,
        dim: int = 3840,
        n_layers: int = 30,
        n_refiner_layers: int = 2,
        n_heads: int = 30,
        n_kv_heads: int = 30,
        norm_eps: float = 1e-5,
        qk_norm: bool = True,
        cap_feat_dim: int = 2560,
        siglip_feat_dim: int | None = None,
        rope_theta: float = 256.0,
        t_scale: float = 1000.0,
        axes_dims=(32, 48, 48),
        axes_lens=(1024, 512, 512),
        dtype: torch.dtype = torch.float32,
        **_ignored,
    ):
        super().__init__()
        if siglip_feat_dim is not None:
            raise ConfigError("siglip_feat_dim is set: the Z-Image omni variant is not supported in-tree")
        if dim % n_heads or dim // n_heads != sum(axes_dims):
            raise ConfigError(f"head_dim = dim / n_heads must equal sum(axes_dims)={sum(axes_dims)}")
        self.in_channels = self.out_channels = in_channels
        self.dim = dim
        self.n_heads = n_heads
        self.t_scale = t_scale
        self.all_patch_size = tuple(all_patch_size)
        self.all_f_patch_size = tuple(all_f_patch_size)
        self._dtype = dtype
        self.all_x_embedder = nn.ModuleDict()
        self.all_final_layer = nn.ModuleDict()
        for p, pf in zip(self.all_patch_size, self.all_f_patch_size, strict=True):
            key = f"{p}-{pf}"
            self.all_x_embedder[key] = ReplicatedLinear(
                pf * p * p * in_channels, dim, bias=True, params_dtype=dtype, prefix=f"all_x_embedder.{key}"
            )
            self.all_final_layer[key] = FinalLayer(
                dim, p * p * pf * in_channels, dtype, f"all_final_layer.{key}"
            )

        def blocks(name: str, n: int, modulation: bool) -> nn.ModuleList:
            return nn.ModuleList(
                ZImageTransformerBlock(
                    dim, n_heads, norm_eps, qk_norm, modulation, dtype, prefix=f"{name}.{i}"
                )
                for i in range(n)
            )

        self.noise_refiner = blocks("noise_refiner", n_refiner_layers, True)
        self.context_refiner = blocks("context_refiner", n_refiner_layers, False)
        self.t_embedder = TimestepEmbedder(min(dim, ADALN_EMBED_DIM), dtype, prefix="t_embedder")
        self.cap_embedder = nn.ModuleList(
            [
                RMSNorm(cap_feat_dim, norm_eps, dtype),
                ReplicatedLinear(cap_feat_dim, dim, bias=True, params_dtype=dtype, prefix="cap_embedder.1"),
            ]
        )
        self.x_pad_token = nn.Parameter(torch.zeros((1, dim), dtype=dtype))
        self.cap_pad_token = nn.Parameter(torch.zeros((1, dim), dtype=dtype))
        self.layers = blocks("layers", n_layers, True)
        self.axes_lens = tuple(int(n) for n in axes_lens)
        self.rope = RopeTable(rope_theta, list(axes_dims), list(axes_lens))

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype the model was built with (inputs are cast to it)."""
        return self._dtype

    def position_limits(self, patch_size: int = 2) -> tuple[int, int, int]:
        """What the rotary tables can index for one latent frame: ``(caption rows, latent H, latent W)``.

        A caption (padded to a multiple of ``SEQ_MULTI_OF`` rows) takes axis-0 positions ``1..L``
        and the image frame the next one, so ``L <= axes_lens[0] - 2``; the image's patch grid
        indexes axes 1 and 2, so a latent side is at most ``axes_lens[i] * patch_size``.
        """
        frame_axis, h_axis, w_axis = self.axes_lens
        caption = (frame_axis - 2) // SEQ_MULTI_OF * SEQ_MULTI_OF
        return caption, h_axis * patch_size, w_axis * patch_size

    # ------------------------------------------------------------------ sequence building
    @staticmethod
    def _pad_to_multiple(feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Repeat the last row up to a multiple of 32 rows; returns (padded, pad_mask bool)."""
        n = feat.shape[0]
        pad = (-n) % SEQ_MULTI_OF
        mask = torch.zeros(n + pad, dtype=torch.bool, device=feat.device)
        if pad:
            feat = torch.cat([feat, feat[-1:].expand(pad, -1)], dim=0)
            mask[n:] = True
        return feat, mask

    def _embed_padded(
        self,
        feats: list[torch.Tensor],
        pad_masks: list[torch.Tensor],
        ids: list[torch.Tensor],
        pad_token,
        embed,
    ):
        """Embed a ragged list, swap pad rows for ``pad_token``, batch with zero padding.

        Returns ``(x (B, Lmax, dim), freqs (B, Lmax, D/2) complex, mask (B, Lmax) bool or None, lengths)``.
        """
        lengths = [f.shape[0] for f in feats]
        # The embedder sees the samples' rows concatenated: declare which rows are whose (a mixed
        # LoRA batch reads it from the forward context).
        with rows_per_sample(lengths):
            x = embed(torch.cat(feats, dim=0))
        x = torch.where(torch.cat(pad_masks).unsqueeze(-1), pad_token.to(x.dtype), x)
        x = pad_sequence(list(x.split(lengths)), batch_first=True)
        freqs = pad_sequence(list(self.rope.lookup(torch.cat(ids)).split(lengths)), batch_first=True)
        return x, freqs, self._mask(lengths, x.device), lengths

    @staticmethod
    def _mask(lengths: list[int], device) -> torch.Tensor | None:
        if len(set(lengths)) == 1:
            return None
        mask = torch.zeros((len(lengths), max(lengths)), dtype=torch.bool, device=device)
        for i, n in enumerate(lengths):
            mask[i, :n] = True
        return mask

    def _patchify(
        self, x: list[torch.Tensor], cap_feats: list[torch.Tensor], patch_size: int, f_patch_size: int
    ) -> tuple[tuple[list, list, list, list], tuple[list, list, list]]:
        """Per sample: padded image patches ``(N_i, C*f*p*p)``, their pad masks, 3-D position ids and
        ``(F, H, W)`` sizes; padded caption features with their masks and position ids (the image
        ids start after the caption's)."""
        device = x[0].device
        img_feats, img_masks, img_ids, sizes = [], [], [], []
        cap_list, cap_masks, cap_ids = [], [], []
        for image, cap in zip(x, cap_feats, strict=True):
            cap_padded, cap_mask = self._pad_to_multiple(cap.to(self._dtype))
            cap_len = cap_padded.shape[0]
            cap_list.append(cap_padded)
            cap_masks.append(cap_mask)
            cap_ids.append(_grid_ids((cap_len, 1, 1), (1, 0, 0), device))

            c, f, h, w = image.shape
            ft, ht, wt = f // f_patch_size, h // patch_size, w // patch_size
            patches = image.to(self._dtype).view(c, ft, f_patch_size, ht, patch_size, wt, patch_size)
            patches = patches.permute(1, 3, 5, 2, 4, 6, 0).reshape(ft * ht * wt, -1)
            n_patches = patches.shape[0]
            patches, img_mask = self._pad_to_multiple(patches)
            ids = _grid_ids((ft, ht, wt), (cap_len + 1, 0, 0), device)
            ids = torch.cat([ids, ids.new_zeros((patches.shape[0] - n_patches, 3))])
            img_feats.append(patches)
            img_masks.append(img_mask)
            img_ids.append(ids)
            sizes.append((f, h, w))
        return (img_feats, img_masks, img_ids, sizes), (cap_list, cap_masks, cap_ids)

    def _unpatchify(
        self, h_joint: torch.Tensor, sizes: list[tuple[int, int, int]], patch_size: int, f_patch_size: int
    ) -> list[torch.Tensor]:
        """The image tokens of each sample (the first ``F*H*W/(f*p*p)`` rows) back to ``(C, F, H, W)``."""
        outs = []
        for i, (f, h, w) in enumerate(sizes):
            ft, ht, wt = f // f_patch_size, h // patch_size, w // patch_size
            tokens = h_joint[i, : ft * ht * wt]
            tokens = tokens.view(ft, ht, wt, f_patch_size, patch_size, patch_size, self.out_channels)
            outs.append(tokens.permute(6, 0, 3, 1, 4, 2, 5).reshape(self.out_channels, f, h, w))
        return outs

    def forward(
        self,
        x: list[torch.Tensor],
        t: torch.Tensor,
        cap_feats: list[torch.Tensor],
        patch_size: int = 2,
        f_patch_size: int = 1,
    ) -> list[torch.Tensor]:
        """Predict the flow for a batch of latents.

        Args:
            x: ``B`` latents, each ``(C=in_channels, F, H, W)`` with ``F % f_patch_size == 0`` and
                ``H, W`` multiples of ``patch_size``; any float dtype (cast to the model dtype).
            t: ``(B,)`` normalised time in ``[0, 1]`` (1 = clean image); scaled by ``t_scale``.
            cap_feats: ``B`` caption features, each ``(L_i, cap_feat_dim)`` (no padding rows).
            patch_size, f_patch_size: one of the configured patch sizes.

        Returns:
            ``B`` tensors shaped like the inputs, in the model dtype.

        Raises:
            ValueError: for an unconfigured patch size or mismatched batch lengths.
        """
        key = f"{patch_size}-{f_patch_size}"
        if key not in self.all_x_embedder:
            raise ValueError(f"patch size {key} not configured; have {list(self.all_x_embedder)}")
        if len(x) != len(cap_feats) or len(x) != t.shape[0]:
            raise ValueError(
                f"batch mismatch: {len(x)} latents, {len(cap_feats)} captions, {t.shape[0]} timesteps"
            )
        device = x[0].device
        adaln = self.t_embedder(t * self.t_scale).to(self._dtype)

        (img_feats, img_masks, img_ids, sizes), (cap_list, cap_masks, cap_ids) = self._patchify(
            x, cap_feats, patch_size, f_patch_size
        )

        xs, x_freqs, x_mask, x_lens = self._embed_padded(
            img_feats, img_masks, img_ids, self.x_pad_token, lambda v: _linear(self.all_x_embedder[key], v)
        )
        for block in self.noise_refiner:
            xs = block(xs, x_mask, x_freqs, adaln)

        def cap_embed(v):
            return _linear(self.cap_embedder[1], self.cap_embedder[0](v))

        caps, cap_freqs, cap_mask, cap_lens = self._embed_padded(
            cap_list, cap_masks, cap_ids, self.cap_pad_token, cap_embed
        )
        for block in self.context_refiner:
            caps = block(caps, cap_mask, cap_freqs)

        joint = [torch.cat([xs[i, : x_lens[i]], caps[i, : cap_lens[i]]]) for i in range(len(x))]
        joint_freqs = [
            torch.cat([x_freqs[i, : x_lens[i]], cap_freqs[i, : cap_lens[i]]]) for i in range(len(x))
        ]
        joint_lens = [j.shape[0] for j in joint]
        h_joint = pad_sequence(joint, batch_first=True)
        freqs = pad_sequence(joint_freqs, batch_first=True)
        mask = self._mask(joint_lens, device)
        for block in self.layers:
            h_joint = block(h_joint, mask, freqs, adaln)
        h_joint = self.all_final_layer[key](h_joint, adaln)

        return self._unpatchify(h_joint, sizes, patch_size, f_patch_size)
