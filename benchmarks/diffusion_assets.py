"""Assets for :mod:`benchmarks.diffusion_lora`: a random Z-Image transformer in diffusers format, PEFT
adapters for it, and the FLOP floor of LoRA on its patched layers (all written once under ``.cache``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
ASSET_VERSION = "1"


def model_config(dim: int, layers: int, refiner: int, cap_dim: int) -> dict:
    head_dim = 128
    return dict(
        all_patch_size=[2],
        all_f_patch_size=[1],
        in_channels=16,
        dim=dim,
        n_layers=layers,
        n_refiner_layers=refiner,
        n_heads=dim // head_dim,
        n_kv_heads=dim // head_dim,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=cap_dim,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[32, 48, 48],
        axes_lens=[1024, 512, 512],
    )


def ensure_transformer(root: Path, cfg: dict) -> Path:
    """Random diffusers-format ``transformer/`` folder for ``cfg`` (built once, seeded)."""
    import torch
    from diffusers import ZImageTransformer2DModel

    name = f"z-image-d{cfg['dim']}-L{cfg['n_layers']}-R{cfg['n_refiner_layers']}-c{cfg['cap_feat_dim']}"
    folder = root / name / "transformer"
    stamp = root / name / ".asset_version"
    if stamp.is_file() and stamp.read_text().strip() == ASSET_VERSION:
        return folder
    torch.manual_seed(0)
    model = ZImageTransformer2DModel(**cfg)
    with torch.no_grad():
        model.x_pad_token.normal_(0, 0.5)
        model.cap_pad_token.normal_(0, 0.5)
    model.save_pretrained(str(folder), safe_serialization=True)
    stamp.write_text(ASSET_VERSION + "\n")
    return folder


def lora_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """diffusers module name -> (d_in, d_out) of every targeted linear."""
    dim = cfg["dim"]
    hidden = int(dim / 3 * 8)
    blocks = [f"layers.{i}" for i in range(cfg["n_layers"])]
    for kind in ("noise_refiner", "context_refiner"):
        blocks += [f"{kind}.{i}" for i in range(cfg["n_refiner_layers"])]
    shapes = {}
    for blk in blocks:
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            shapes[f"{blk}.attention.{proj}"] = (dim, dim)
        shapes[f"{blk}.feed_forward.w1"] = (dim, hidden)
        shapes[f"{blk}.feed_forward.w3"] = (dim, hidden)
        shapes[f"{blk}.feed_forward.w2"] = (hidden, dim)
    return shapes


def ensure_adapter(folder: Path, cfg: dict, r: int, seed: int) -> Path:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    if (folder / "adapter_model.safetensors").is_file():
        return folder
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (d_in, d_out) in lora_shapes(cfg).items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(r, d_in, generator=gen) / d_in**0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, r, generator=gen) * 0.02
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=r, lora_alpha=r, target_modules=TARGETS, lora_dropout=0.0).save_pretrained(str(tmp))
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    os.replace(tmp, folder)
    return folder


def adapter_metadata(folder: Path) -> dict:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    keys = ("r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern", "bias")
    return {k: cfg[k] for k in keys if cfg.get(k) is not None}


def flop_floor(cfg: dict, r: int, image_tokens: int, cap_tokens: int) -> tuple[float, float]:
    """(floor over the patched layers, patched layers' share of the step's matmul+attention FLOPs).

    floor = sum_l T_l r (d_in + d_out) / sum_l T_l d_in d_out with T_l the tokens layer l sees.
    """
    tokens = {
        "layers": image_tokens + cap_tokens,
        "noise_refiner": image_tokens,
        "context_refiner": cap_tokens,
    }
    lora = base = 0.0
    for module, (d_in, d_out) in lora_shapes(cfg).items():
        t = tokens[module.split(".")[0]]
        lora += t * r * (d_in + d_out)
        base += t * d_in * d_out
    dim = cfg["dim"]
    attn = sum(
        4 * t * t * dim * (cfg["n_layers"] if k == "layers" else cfg["n_refiner_layers"])
        for k, t in tokens.items()
    )
    return lora / base, base / (base + attn)
