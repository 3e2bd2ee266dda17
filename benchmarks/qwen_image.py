"""Qwen-Image denoiser step: in-tree vs diffusers on the same weights, and LoRA cost per step, in one run.

Both sides load one random ``QwenImageTransformer2DModel`` written in diffusers format under
``.cache/bench_assets`` (sizes from the flags), and one PEFT adapter (rank ``--rank``, every
attention, MLP and modulation layer of every block):

* in-tree: ``vllm_omni.diffusion.models.qwen_image`` on vLLM layers (TP=1) + ``DiffusionLoRAManager``;
* diffusers fallback: diffusers' ``QwenImageTransformer2DModel`` (what ``pipeline_backend="diffusers"``
  runs) + peft through ``load_lora_adapter`` / ``set_adapters``.

One denoiser forward on a CFG batch (2 samples, ``--image`` px square, ``--text`` prompt tokens, one of
them padded) is one denoising step. Steps are interleaved (``benchmarks.timing.paired``) and the
medians of ``--repeats`` are reported, with the ratios (``benchmarks/denoiser_pair.py``):

1. ``in-tree / diffusers`` step time without adapters (in-tree not slower: <= 1);
2. per side, step time with the adapter / without (the LoRA cost per step), and ours vs theirs.

Run from the repository root (one intra-op thread; CPU time of this process, see benchmarks/timing.py)::

    .venv/bin/python -m benchmarks.qwen_image            # dim 512, 4 blocks, 256 px (256 image tokens)
    .venv/bin/python -m benchmarks.qwen_image --quick    # dim 128, 2 blocks, 128 px, smoke run
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.denoiser_pair import add_common_flags, compare, emit, write_random_adapter

REPO = Path(__file__).resolve().parent.parent
TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"]
TARGETS += ["net.0.proj", "net.2", "img_mod.1", "txt_mod.1"]


def _assets(heads: int, layers: int, rank: int) -> tuple[Path, Path]:
    """The transformer folder and the adapter folder (written once, seeded)."""
    import torch
    from diffusers import QwenImageTransformer2DModel

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
    write_random_adapter(QwenImageTransformer2DModel, model_dir, lora_dir, rank, TARGETS)
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
    from diffusers import QwenImageTransformer2DModel as Reference

    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
    from vllm_omni.diffusion.models.qwen_image import QwenImageTransformer2DModel

    torch.set_num_threads(1)
    model_dir, lora_dir = _assets(args.heads, args.layers, args.rank)
    init_diffusion_parallel_state(1, 0)
    ours = QwenImageTransformer2DModel.from_pretrained(model_dir)
    ref = Reference.from_pretrained(str(model_dir)).eval()
    x, txt, mask, t, shapes = _inputs(args.image, args.text)
    result = compare(
        ours,
        lambda: ours(x, txt, mask, t, shapes),
        ref,
        lambda: ref(x, txt, mask, t, shapes, return_dict=False)[0],
        lora_dir,
        args.rank,
        args.repeats,
    )
    return {"config": vars(args), **result}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="dim 128, 2 blocks, 128 px, 3 repeats")
    p.add_argument("--heads", type=int, default=8, help="attention heads of 64 channels (dim = 64 x heads)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--image", type=int, default=256, help="image side in pixels (multiple of 16)")
    p.add_argument("--text", type=int, default=64, help="prompt tokens")
    add_common_flags(p)
    args = p.parse_args(argv)
    if args.quick:
        args.heads, args.layers, args.image, args.repeats = 2, 2, 128, 3
    return emit(run(args), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
