"""A PEFT LoRA adapter on the tiny checkpoint's talker (peft on transformers' talker sub-model)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_talker_adapter(model_dir: str, out_dir: Path, *, r: int = 8, seed: int = 606) -> Path:
    """Write an adapter on the talker decoder's ``q_proj``/``v_proj`` (keys
    ``base_model.model.model.layers...``) into ``out_dir``; ``lora_A``/``lora_B`` are seeded
    noise (peft's default ``lora_B`` is zero). Returns ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5OmniForConditionalGeneration

    full = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(full.talker, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)
