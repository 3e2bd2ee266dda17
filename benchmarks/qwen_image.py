"""Qwen-Image denoiser step: in-tree vs diffusers on the same weights, and LoRA cost per step, in one run.

Both sides load one random ``QwenImageTransformer2DModel`` written in diffusers format under
``.cache/bench_assets`` (sizes from the flags), and one PEFT adapter (rank ``--rank``, every
attention, MLP and modulation layer of every block):

* in-tree: ``vllm_omni.diffusion.models.qwen_image`` on vLLM layers (TP=1) + ``DiffusionLoRAManager``;
* diffusers fallback: diffusers' ``QwenImageTransformer2DModel`` (what ``pipeline_backend="diffusers"``
  runs) + peft through ``load_lora_adapter`` / ``set_adapters``.

One denoiser forward on a CFG batch (2 samples, ``--image`` px square, ``--text`` prompt tokens, one of
them padded) is one denoising step. Steps are interleaved (in-tree, diffusers; base, LoRA) and the
medians of ``--repeats`` are reported, with the ratios:

1. ``in-tree / diffusers`` step time without adapters (in-tree not slower: <= 1);
2. per side, step time with the adapter / without (the LoRA cost per step), and ours vs theirs.

Run from the repository root (one intra-op thread; CPU time of this process, see benchmarks/timing.py)::

    .venv/bin/python -m benchmarks.qwen_image            # dim 512, 4 blocks, 256 px (256 image tokens)
    .venv/bin/python -m benchmarks.qwen_image --quick    # dim 128, 2 blocks, 128 px, smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from benchmarks.timing import Timer, median

REPO = Path(__file__).resolve().parent.parent
TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"]
TARGETS += ["net.0.proj", "net.2", "img_mod.1", "txt_mod.1"]


def _assets(heads: int, layers: int, rank: int) -> tuple[Path, Path]:
    """The transformer folder and the adapter folder (written once, seeded)."""
    import torch
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig, get_peft_model

    root = REPO / ".cache" / "bench_assets" / f"qwen_image_h{heads}_l{layers}"
    model_dir, lora_dir = root / "transformer", root / f"lora_r{rank}"
    if not (model_dir / "config.json").is_file():
        torch.manual_seed(0)
        QwenImageTransformer2DModel(
            num_layers=layers,
            attention_head_dim=64,
            num_attention_heads=heads,
            joint_attention_dim=256,
            axes_dims_rope=(16, 24, 24),
        ).save_pretrained(model_dir, safe_serialization=True)
    if not (lora_dir / "adapter_config.json").is_file():
        base = QwenImageTransformer2DModel.from_pretrained(str(model_dir))
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS))
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in sorted(model.named_parameters()):
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        model.save_pretrained(str(lora_dir))
    return model_dir, lora_dir


def _inputs(image: int, text: int):
    import torch

    g = torch.Generator().manual_seed(0)
    grid = image // 16
    x = torch.randn(2, grid * grid, 64, generator=g)
    txt = torch.randn(2, text, 256, generator=g)
    mask = torch.ones(2, text, dtype=torch.long)
    mask[1, text // 2 :] = 0
    return x, txt, mask, torch.tensor([0.7, 0.7]), [[(1, grid, grid)]] * 2


def run(args) -> dict:
    import torch
    from safetensors.torch import load_file

    from tools.make_tiny_diffusion_lora import adapter_config_metadata
    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
    from vllm_omni.diffusion.lora import DiffusionLoRAManager
    from vllm_omni.diffusion.models.qwen_image import QwenImageTransformer2DModel
    from vllm_omni.lora.request import LoRARequest

    torch.set_num_threads(1)
    model_dir, lora_dir = _assets(args.heads, args.layers, args.rank)
    from diffusers import QwenImageTransformer2DModel as Reference

    init_diffusion_parallel_state(1, 0)
    ours = QwenImageTransformer2DModel.from_pretrained(model_dir)
    ref = Reference.from_pretrained(str(model_dir)).eval()
    x, txt, mask, t, shapes = _inputs(args.image, args.text)

    def ours_step():
        return ours(x, txt, mask, t, shapes)

    def ref_step():
        return ref(x, txt, mask, t, shapes, return_dict=False)[0]

    manager = DiffusionLoRAManager(ours, max_loras=1, max_rank=args.rank, max_cpu_loras=2)
    request = LoRARequest("bench", 1, str(lora_dir))
    manager.add_lora(request)
    state = {
        k.removeprefix("base_model.model."): v
        for k, v in load_file(str(lora_dir / "adapter_model.safetensors")).items()
    }
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
    timer = Timer("cpu", "cpu")
    times = {(side, lora): [] for side in sides for lora in (False, True)}
    with torch.inference_mode():
        for step, base, lora in sides.values():
            lora()
            step()
            base()
            step()
        err = (ours_step() - ref_step()).abs().max().item()
        for _ in range(args.repeats):
            for side, (step, base, lora) in sides.items():
                base()
                times[side, False].append(timer(step))
                lora()
                times[side, True].append(timer(step))
    med = {f"{side}{'_lora' if lora else ''}_s": median(v) for (side, lora), v in times.items()}
    result = {
        "config": vars(args),
        "host": platform.processor() or platform.machine(),
        "max_abs_diff_base": err,
        **med,
        "in_tree_over_diffusers": med["in_tree_s"] / med["diffusers_s"],
        "lora_cost_in_tree": med["in_tree_lora_s"] / med["in_tree_s"],
        "lora_cost_diffusers_peft": med["diffusers_lora_s"] / med["diffusers_s"],
        "lora_step_in_tree_over_diffusers_peft": med["in_tree_lora_s"] / med["diffusers_lora_s"],
    }
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="dim 128, 2 blocks, 128 px, 3 repeats")
    p.add_argument("--heads", type=int, default=8, help="attention heads of 64 channels (dim = 64 x heads)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--image", type=int, default=256, help="image side in pixels (multiple of 16)")
    p.add_argument("--text", type=int, default=64, help="prompt tokens")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.heads, args.layers, args.image, args.repeats = 2, 2, 128, 3
    result = run(args)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
