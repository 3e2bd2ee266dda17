"""What the in-tree-vs-diffusers denoiser benchmarks share (``benchmarks/qwen_image.py``,
``benchmarks/wan_in_tree.py``): a seeded random PEFT adapter for a diffusers denoiser, the two sides
with one adapter loaded each (ours through ``DiffusionLoRAManager``, diffusers' through peft), the
interleaved measurement and the ratios reported."""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from pathlib import Path

from benchmarks.timing import Timer, paired


def write_random_adapter(model_cls, model_dir: Path, lora_dir: Path, rank: int, targets: list[str]) -> None:
    """A PEFT adapter (``r = lora_alpha = rank`` on ``targets``) of the diffusers model in ``model_dir``,
    with seeded ``N(0, 0.02)`` weights, saved to ``lora_dir`` once."""
    import torch
    from peft import LoraConfig, get_peft_model

    if (lora_dir / "adapter_config.json").is_file():
        return
    base = model_cls.from_pretrained(str(model_dir))
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=rank, target_modules=targets))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    model.save_pretrained(str(lora_dir))


def compare(
    ours, ours_step: Callable, ref, ref_step: Callable, lora_dir: Path, rank: int, repeats: int
) -> dict:
    """Both denoisers with the adapter in ``lora_dir`` loaded, measured interleaved
    (:func:`benchmarks.timing.paired`, CPU time, one thread as set by the caller).

    Returns:
        Largest output differences without and with the adapter, the median step times and the ratios:
        in-tree over diffusers (base), LoRA cost per step of each side, and the in-tree LoRA step over
        diffusers+peft's.
    """
    import torch
    from safetensors.torch import load_file

    from tools.make_tiny_diffusion_lora import adapter_config_metadata
    from vllm_omni.diffusion.lora import DiffusionLoRAManager
    from vllm_omni.lora.request import LoRARequest

    manager = DiffusionLoRAManager(ours, max_loras=1, max_rank=rank, max_cpu_loras=2)
    request = LoRARequest("bench", 1, str(lora_dir))
    manager.add_lora(request)
    state = load_file(str(lora_dir / "adapter_model.safetensors"))
    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    ref.load_lora_adapter(
        state, prefix=None, adapter_name="bench", metadata=adapter_config_metadata(lora_dir)
    )
    sides = {
        "in_tree": (ours_step, manager.deactivate, lambda: manager.set_active_adapters([request], [1.0])),
        "diffusers": (
            ref_step,
            ref.disable_adapters,
            lambda: (ref.enable_adapters(), ref.set_adapters(["bench"], [1.0])),
        ),
    }
    with torch.inference_mode():
        errs = {}
        for lora in (False, True):
            for _, base, with_lora in sides.values():
                (with_lora if lora else base)()
            errs["lora" if lora else "base"] = (ours_step() - ref_step()).abs().max().item()
        stats = paired(Timer("cpu", "cpu"), sides, repeats, warm_base=True)
    ours_s, ref_s = stats["in_tree"], stats["diffusers"]
    return {
        "host": platform.processor() or platform.machine(),
        "max_abs_diff": errs,
        "in_tree_s": ours_s["base_s"],
        "diffusers_s": ref_s["base_s"],
        "in_tree_lora_s": ours_s["lora_s"],
        "diffusers_lora_s": ref_s["lora_s"],
        "in_tree_over_diffusers": ours_s["base_s"] / ref_s["base_s"],
        "lora_cost_in_tree": ours_s["ratio"],
        "lora_cost_diffusers_peft": ref_s["ratio"],
        "lora_step_in_tree_over_diffusers_peft": ours_s["lora_s"] / ref_s["lora_s"],
    }


def emit(result: dict, out: Path | None) -> int:
    """Print ``result`` as JSON (and write it to ``out``); the exit status of a benchmark's ``main``."""
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if out:
        out.write_text(text + "\n")
    return 0


def add_common_flags(p: argparse.ArgumentParser) -> None:
    """``--rank``, ``--repeats``, ``--out`` as both benchmarks take them."""
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
