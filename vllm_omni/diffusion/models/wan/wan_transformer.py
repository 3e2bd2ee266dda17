"""Wan (2.1 / 2.2) video denoiser built from vLLM tensor-parallel linear layers.

Same maths and parameter names as diffusers' ``WanTransformer3DModel`` (``transformer_wan.py``):

* latents ``(B, C, F, H, W)`` are cut into ``(p_t, p_h, p_w)`` patches by ``patch_embedding``
  (a ``Conv3d`` with stride = kernel, replicated) and flattened to ``F' * H' * W'`` tokens;
* ``condition_embedder`` turns the timestep into ``temb`` and six modulation vectors, and projects
  the UMT5 text features (and, for I2V, the CLIP image features) to the model width;
* each of ``blocks`` runs adaLN-modulated self-attention (3-D RoPE over frames x height x width),
  cross-attention to the text (+ image) tokens and a modulated tanh-GELU FFN; modulation is
  ``scale_shift_table + timestep_proj`` (diffusers' order of float32 casts is kept);
* ``norm_out`` modulated by ``scale_shift_table + temb``, ``proj_out`` and un-patchify.

Two-dimensional timesteps ``(B, L)`` (Wan2.2 TI2V's per-token timesteps) are accepted as in diffusers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.layers.linear import ReplicatedLinear

from vllm_omni.diffusion.forward_context import rows_per_sample
from vllm_omni.diffusion.models.layers import linear_out
from vllm_omni.diffusion.models.wan.layers import (
    WanConditionEmbedder,
    WanCrossAttention,
    WanFeedForward,
    WanRope,
    WanSelfAttention,
    fp32_layer_norm,
)
from vllm_omni.diffusion.models.weight_loading import load_denoiser, load_stacked_weights
from vllm_omni.errors import ConfigError

#: checkpoint tensors diffusers itself ignores when loading (``_keys_to_ignore_on_load_unexpected``)
IGNORED_KEYS = ("norm_added_q",)


class WanTransformerBlock(nn.Module):
    """Self-attention, cross-attention and FFN with adaLN modulation (diffusers' ``WanTransformerBlock``)."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        heads: int,
        cross_attn_norm: bool,
        eps: float,
        added_kv_proj_dim: int | None,
        dtype: torch.dtype,
        prefix: str = "",
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanSelfAttention(dim, heads, eps, dtype, prefix=f"{prefix}.attn1")
        self.attn2 = WanCrossAttention(dim, heads, eps, added_kv_proj_dim, dtype, prefix=f"{prefix}.attn2")
        self.norm2 = nn.LayerNorm(dim, eps, elementwise_affine=True, dtype=dtype) if cross_attn_norm else None
        self.ffn = WanFeedForward(dim, ffn_dim, dim, dtype, "tanh", parallel=True, prefix=f"{prefix}.ffn")
        self.norm3 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6, dim, dtype=torch.float32))

    def forward(
        self,
        x: torch.Tensor,
        text: torch.Tensor,
        image: torch.Tensor | None,
        modulation: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` ``(B, L, dim)``; ``modulation`` ``(B, 6, dim)`` or per token ``(B, L, 6, dim)``; the rotary
        table ``(L, head_dim / 2)`` as two tensors (a compiled block takes tensors, not tuples)."""
        if modulation.ndim == 4:
            parts = (self.scale_shift_table.unsqueeze(0) + modulation.float()).chunk(6, dim=2)
            parts = [p.squeeze(2) for p in parts]
        else:
            parts = (self.scale_shift_table + modulation.float()).chunk(6, dim=1)
        shift, scale, gate, c_shift, c_scale, c_gate = parts
        h = (fp32_layer_norm(self.norm1, x.float()) * (1 + scale) + shift).type_as(x)
        x = (x.float() + self.attn1(h, (rope_cos, rope_sin)) * gate).type_as(x)
        h = fp32_layer_norm(self.norm2, x.float()).type_as(x) if self.norm2 is not None else x
        x = x + self.attn2(h, text, image)
        h = (fp32_layer_norm(self.norm3, x.float()) * (1 + c_scale) + c_shift).type_as(x)
        return (x.float() + self.ffn(h).float() * c_gate).type_as(x)


class WanTransformer3DModel(nn.Module):
    """Wan denoiser (diffusers ``WanTransformer3DModel`` checkpoint layout) on vLLM linear layers.

    Construct after :func:`~vllm_omni.diffusion.distributed.parallel_state.init_diffusion_parallel_state`
    and under ``current_vllm_config_for_layers()``; :meth:`from_pretrained` does the latter itself.
    Constructor arguments are the diffusers ``config.json`` fields plus ``dtype`` (the time embedder
    and the modulation tables stay float32, as diffusers keeps them).

    Patchable linear layers (``{b}`` = ``blocks.i``): ``{b}.attn1.to_qkv`` (QKVParallelLinear, packs
    the checkpoint's ``to_q/to_k/to_v``), ``{b}.attn1.to_out.0``, ``{b}.attn2.to_q|to_k|to_v``
    (ColumnParallelLinear), ``{b}.attn2.add_k_proj|add_v_proj`` (I2V), ``{b}.attn2.to_out.0``,
    ``{b}.ffn.net.0.proj`` (ColumnParallelLinear), ``{b}.ffn.net.2`` (RowParallelLinear), and the
    replicated ``condition_embedder.{time_embedder,text_embedder}.linear_1|2``,
    ``condition_embedder.time_proj``, ``proj_out``. ``patch_embedding`` is a plain ``Conv3d``.
    """

    #: ``(packed_param, checkpoint_sub_module, shard_id)``: checkpoint projections packed into one vLLM
    #: layer (read by the weight loader and the LoRA manager). Only ``attn1`` holds a ``to_qkv``.
    stacked_params_mapping: list[tuple[str, str, str | int]] = [
        ("to_qkv", "to_q", "q"),
        ("to_qkv", "to_k", "k"),
        ("to_qkv", "to_v", "v"),
    ]
    #: the repeated block class (diffusers' convention; regional compilation reads it)
    _repeated_blocks = ("WanTransformerBlock",)

    def __init__(
        self,
        patch_size=(1, 2, 2),
        num_attention_heads: int = 40,
        attention_head_dim: int = 128,
        in_channels: int = 16,
        out_channels: int | None = 16,
        text_dim: int = 4096,
        freq_dim: int = 256,
        ffn_dim: int = 13824,
        num_layers: int = 40,
        cross_attn_norm: bool = True,
        qk_norm: str | None = "rms_norm_across_heads",
        eps: float = 1e-6,
        image_dim: int | None = None,
        added_kv_proj_dim: int | None = None,
        rope_max_seq_len: int = 1024,
        pos_embed_seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        **_ignored,
    ):
        super().__init__()
        if qk_norm not in ("rms_norm_across_heads", None):
            raise ConfigError(
                f"qk_norm={qk_norm!r}: the in-tree Wan denoiser implements 'rms_norm_across_heads'"
            )
        dim = num_attention_heads * attention_head_dim
        self.patch_size = tuple(int(p) for p in patch_size)
        self.in_channels = in_channels
        self.out_channels = out_channels or in_channels
        self.dim = dim
        self._dtype = dtype
        self.rope = WanRope(attention_head_dim, rope_max_seq_len)
        self.patch_embedding = nn.Conv3d(
            in_channels, dim, kernel_size=self.patch_size, stride=self.patch_size, dtype=dtype
        )
        self.condition_embedder = WanConditionEmbedder(
            dim, freq_dim, text_dim, image_dim, pos_embed_seq_len, dtype
        )
        self.blocks = nn.ModuleList(
            WanTransformerBlock(
                dim,
                ffn_dim,
                num_attention_heads,
                cross_attn_norm,
                eps,
                added_kv_proj_dim,
                dtype,
                f"blocks.{i}",
            )
            for i in range(num_layers)
        )
        self.norm_out = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.proj_out = ReplicatedLinear(
            dim,
            self.out_channels * math.prod(self.patch_size),
            bias=True,
            params_dtype=dtype,
            prefix="proj_out",
        )
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 2, dim, dtype=torch.float32))

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype the model was built with (inputs are cast to it)."""
        return self._dtype

    @property
    def accepts_image_embeds(self) -> bool:
        """Whether the model has image cross-attention (Wan2.1 I2V / FLF2V checkpoints)."""
        return self.condition_embedder.image_embedder is not None

    def _embed_time(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B,)`` -> ``temb (B, dim)``, modulation ``(B, 6, dim)``; ``(B, L)`` -> ``(B, L, dim)``,
        ``(B, L, 6, dim)`` (the time layers then see ``B * L`` rows, declared per sample)."""
        if timestep.ndim == 2:
            batch, length = timestep.shape
            with rows_per_sample([length] * batch):
                temb, proj = self.condition_embedder.time_forward(timestep.flatten(), dtype)
            return temb.unflatten(0, (batch, length)), proj.unflatten(0, (batch, length)).unflatten(
                2, (6, -1)
            )
        temb, proj = self.condition_embedder.time_forward(timestep, dtype)
        return temb, proj.unflatten(1, (6, -1))

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow for a batch of video latents.

        Args:
            hidden_states: ``(B, in_channels, F, H, W)``; ``F, H, W`` multiples of ``patch_size``.
            timestep: ``(B,)`` scheduler timesteps (0..1000), or ``(B, F'*H'*W')`` per token.
            encoder_hidden_states: ``(B, L_text, text_dim)`` text features (diffusers pads them with
                zeros to ``max_sequence_length``; the padding rows take part in attention).
            encoder_hidden_states_image: ``(B, L_img, image_dim)`` image features for I2V models.

        Returns:
            ``(B, out_channels, F, H, W)`` in the model dtype.

        Raises:
            ValueError: sizes that are not multiples of the patch, a grid beyond the rotary table,
                image features for a model without image cross-attention (or none for one with it).
        """
        batch, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        if frames % p_t or height % p_h or width % p_w:
            raise ValueError(
                f"latent size {(frames, height, width)} is not a multiple of the patch {self.patch_size}"
            )
        grid = (frames // p_t, height // p_h, width // p_w)
        if (encoder_hidden_states_image is None) == self.accepts_image_embeds:
            need = "needs" if self.accepts_image_embeds else "takes no"
            raise ValueError(f"this Wan denoiser {need} image embeddings (encoder_hidden_states_image)")
        rope = self.rope.grid(*grid, hidden_states.device)
        x = self.patch_embedding(hidden_states.to(self._dtype)).flatten(2).transpose(1, 2).contiguous()
        text = encoder_hidden_states.to(self._dtype)
        temb, modulation = self._embed_time(timestep, text.dtype)
        text = self.condition_embedder.text_embedder(text)
        image = None
        if encoder_hidden_states_image is not None:
            image = self.condition_embedder.image_embedder(encoder_hidden_states_image.to(self._dtype))
        for block in self.blocks:
            x = block(x, text, image, modulation, *rope)
        if temb.ndim == 3:
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (fp32_layer_norm(self.norm_out, x.float()) * (1 + scale) + shift).type_as(x)
        x = linear_out(self.proj_out, x)
        x = x.reshape(batch, *grid, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        folder: str | os.PathLike,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        keep_base_weights: bool = True,
    ) -> WanTransformer3DModel:
        """Build from a diffusers ``transformer/`` folder (``config.json`` + safetensors), load this rank's shard.

        Requires an initialised diffusion parallel state; ``keep_base_weights`` is passed to
        :func:`~vllm_omni.diffusion.models.weight_loading.finalize_linear_layers`.

        Raises:
            FileNotFoundError: missing config or weights. ConfigError: checkpoint/config mismatch
                (names the unexpected and missing tensors).
        """
        return load_denoiser(cls, folder, dtype, device, keep_base_weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load diffusers-named tensors through :attr:`stacked_params_mapping` (strict; see
        ``load_stacked_weights``); tensors diffusers ignores (:data:`IGNORED_KEYS`) are skipped."""
        kept = ((n, t) for n, t in weights if not any(part in n.split(".") for part in IGNORED_KEYS))
        return load_stacked_weights(self, kept, self.stacked_params_mapping)
