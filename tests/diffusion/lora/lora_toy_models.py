"""Toy DiT blocks for the diffusion LoRA tests.

``TorchToyDiT`` uses separate ``nn.Linear`` layers (what peft wraps; the oracle). ``VllmToyDiT`` is the
same network on vLLM layers with packed ``to_qkv`` / ``w13``, built from the same weights through
``stacked_params_mapping``. Both compute, per block::

    h = x + adaLN(c)[:, None];  q, k, v = to_q(h), to_k(h), to_v(h)   (GQA: k/v repeated per group)
    x = x + to_out.0(attention(q, k, v));  x = x + w2(silu(w1(x)) * w3(x))
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, N_BLOCKS = 32, 4, 2, 8, 48, 2
STACKED_PARAMS_MAPPING = [
    ("to_qkv", "to_q", "q"),
    ("to_qkv", "to_k", "k"),
    ("to_qkv", "to_v", "v"),
    ("w13", "w1", 0),
    ("w13", "w3", 1),
]
PEFT_TARGETS = ["adaLN", "to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    b, s, _ = q.shape
    q = q.view(b, s, heads, HEAD_DIM).transpose(1, 2)
    k = k.view(b, s, kv_heads, HEAD_DIM).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    v = v.view(b, s, kv_heads, HEAD_DIM).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, s, heads * HEAD_DIM)


class TorchBlock(nn.Module):
    def __init__(self, heads: int = HEADS, kv_heads: int = KV_HEADS) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.adaLN = nn.Linear(DIM, DIM)
        self.attn = nn.Module()
        self.attn.to_q = nn.Linear(DIM, heads * HEAD_DIM)
        self.attn.to_k = nn.Linear(DIM, kv_heads * HEAD_DIM)
        self.attn.to_v = nn.Linear(DIM, kv_heads * HEAD_DIM)
        self.attn.to_out = nn.ModuleList([nn.Linear(heads * HEAD_DIM, DIM)])
        self.ff = nn.Module()
        self.ff.w1 = nn.Linear(DIM, FFN, bias=False)
        self.ff.w3 = nn.Linear(DIM, FFN, bias=False)
        self.ff.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = x + self.adaLN(c)[:, None]
        a = _attention(self.attn.to_q(h), self.attn.to_k(h), self.attn.to_v(h), self.heads, self.kv_heads)
        x = x + self.attn.to_out[0](a)
        return x + self.ff.w2(F.silu(self.ff.w1(x)) * self.ff.w3(x))


class TorchToyDiT(nn.Module):
    def __init__(self, heads: int = HEADS, kv_heads: int = KV_HEADS, n_blocks: int = N_BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TorchBlock(heads, kv_heads) for _ in range(n_blocks)])

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, c)
        return x


def _first(out):
    return out[0] if isinstance(out, tuple) else out


class VllmBlock(nn.Module):
    def __init__(self, heads: int = HEADS, kv_heads: int = KV_HEADS) -> None:
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            QKVParallelLinear,
            ReplicatedLinear,
            RowParallelLinear,
        )

        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.adaLN = ReplicatedLinear(DIM, DIM, bias=True)
        self.attn = nn.Module()
        self.attn.to_qkv = QKVParallelLinear(DIM, HEAD_DIM, heads, kv_heads, bias=True)
        self.attn.to_out = nn.ModuleList([RowParallelLinear(heads * HEAD_DIM, DIM, bias=True)])
        self.ff = nn.Module()
        self.ff.w13 = MergedColumnParallelLinear(DIM, [FFN, FFN], bias=False)
        self.ff.w2 = RowParallelLinear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        qkv_layer = self.attn.to_qkv
        h = x + _first(self.adaLN(c))[:, None]
        tp = qkv_layer.tp_size
        heads, kv = self.heads // tp, max(1, self.kv_heads // tp)
        q, k, v = _first(qkv_layer(h)).split([heads * HEAD_DIM, kv * HEAD_DIM, kv * HEAD_DIM], dim=-1)
        x = x + _first(self.attn.to_out[0](_attention(q, k, v, heads, kv)))
        g, u = _first(self.ff.w13(x)).chunk(2, dim=-1)
        return x + _first(self.ff.w2(F.silu(g) * u))


class VllmToyDiT(nn.Module):
    stacked_params_mapping = STACKED_PARAMS_MAPPING

    def __init__(self, heads: int = HEADS, kv_heads: int = KV_HEADS, n_blocks: int = N_BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([VllmBlock(heads, kv_heads) for _ in range(n_blocks)])

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, c)
        return x


def make_torch_dit(seed: int = 0, **kwargs) -> TorchToyDiT:
    torch.manual_seed(seed)
    return TorchToyDiT(**kwargs).eval()  # default nn.Linear init keeps activations O(1)


def make_vllm_dit(state_dict: dict[str, torch.Tensor], process: bool = True, **kwargs) -> VllmToyDiT:
    """Build the vLLM twin and load ``state_dict`` (TorchToyDiT names) through the packed mapping."""

    from vllm_omni.diffusion.distributed.parallel_state import current_vllm_config_for_layers

    with current_vllm_config_for_layers():
        model = VllmToyDiT(**kwargs)
    params = dict(model.named_parameters())
    for name, tensor in state_dict.items():
        shard = None
        for packed, sub, shard_id in STACKED_PARAMS_MAPPING:
            if f".{sub}." in name:
                name, shard = name.replace(f".{sub}.", f".{packed}."), shard_id
                break
        param = params[name]
        loader = param.weight_loader
        loader(param, tensor) if shard is None else loader(param, tensor, shard)
    if process:
        process_weights(model)
    return model.eval()


def process_weights(model: nn.Module) -> None:
    from vllm.model_executor.layers.linear import LinearBase

    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)


def save_peft_adapter(
    base: nn.Module,
    path: str,
    seed: int,
    *,
    targets=None,
    r: int = 4,
    lora_alpha: float = 8.0,
    **config_kwargs,
) -> nn.Module:
    """Wrap a copy of ``base`` with peft, randomise lora_A and lora_B, save to ``path``; return the peft model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, target_modules=targets or PEFT_TARGETS, lora_dropout=0.0, **config_kwargs
    )
    model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return model.eval()


def inputs(batch: int = 1, seq: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, DIM, generator=gen), torch.randn(batch, DIM, generator=gen)


def tp_worker(rank: int, world_size: int, init_file: str, jobs: list[dict]) -> None:
    """One tensor-parallel rank: for each job, build the vLLM toy, run LoRA (manager or fuse); rank 0
    saves each job's output (one process pair serves every job: one interpreter start)."""
    import torch

    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
    from vllm_omni.diffusion.lora import DiffusionLoRAManager, fuse_lora_into_model
    from vllm_omni.lora.request import LoRARequest

    init_diffusion_parallel_state(world_size, rank, f"file://{init_file}", backend="gloo")
    for job in jobs:
        state_dict = torch.load(job["state_dict"])
        x, c = inputs(batch=len(job["sets"]), seed=21)
        out = {}
        with torch.no_grad():
            model = make_vllm_dit(state_dict, process=False, kv_heads=job["kv_heads"])
            fuse_lora_into_model(model, job["fuse_file"], scale=job["fuse_scale"])
            process_weights(model)
            out["fused"] = model(x, c)
            model = make_vllm_dit(state_dict, kv_heads=job["kv_heads"])
            manager = DiffusionLoRAManager(model, max_loras=2, max_rank=8)
            requests = [[LoRARequest(f"l{i}", i, p) for i, p in entries] for entries, _ in job["sets"]]
            manager.set_active_adapters(requests, [scales for _, scales in job["sets"]])
            out["batched"] = model(x, c)
        if rank == 0:
            torch.save(out, job["out"])


def save_lycoris_adapter(base: nn.Module, path: str, cls_name: str, seed: int, **config_kwargs) -> str:
    """Wrap a copy of ``base`` with peft's ``cls_name`` (``"LoHaConfig"`` / ``"LoKrConfig"``) on every
    target, randomise its factors, save to ``path`` and return ``path``."""
    import peft

    config = getattr(peft, cls_name)(target_modules=PEFT_TARGETS, **config_kwargs)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "hada_" in name or "lokr_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(path)
    return path
