"""Wan denoiser step: in-tree vs diffusers (the fallback's model) on the same weights, and LoRA cost per step.

Both sides load one random ``WanTransformer3DModel`` written in diffusers format under
``.cache/bench_assets`` (sizes from the flags) and one PEFT adapter (rank ``--rank`` on every attention
projection and both FFN layers of every block):

* in-tree: ``vllm_omni.diffusion.models.wan`` on vLLM layers (TP=1) + ``DiffusionLoRAManager``;
* diffusers: ``WanTransformer3DModel`` (what ``pipeline_backend="diffusers"`` runs) + peft through
  ``load_lora_adapter`` / ``set_adapters``.

One denoiser forward on a CFG batch (2 samples of ``--frames`` video frames at ``--size`` px square,
512 text tokens as ``WanPipeline`` pads them) is one denoising step. Steps are interleaved
(``benchmarks.timing.paired``) and medians of ``--repeats`` are reported with the ratios
``in_tree_over_diffusers`` (base step, <= 1 is not slower) and the LoRA cost per step of each side.

Run from the repository root (one intra-op thread; CPU time of this process)::

    .venv/bin/python -m benchmarks.wan_in_tree           # dim 512 (4 x 128), 4 blocks, 9 frames, 128 px
    .venv/bin/python -m benchmarks.wan_in_tree --quick   # dim 256, 2 blocks, 5 frames, 64 px
    .venv/bin/python -m benchmarks.wan_in_tree --compile-check   # compiled stage == eager (tiny two experts)

``--compile-check`` runs the tiny Wan2.2-style directory (``tools/make_tiny_wan.py --moe``) through ``Omni``
eagerly and compiled (``enforce_eager=False``: regional compilation of both experts' blocks, LoRA from
fixed-shape banks) without adapters, with the ``[high, low]`` pair and with the pair at other scales, and
prints the largest difference of the final latents (float32) and the wall time of each run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.denoiser_pair import add_common_flags, compare, emit, write_random_adapter

REPO = Path(__file__).resolve().parent.parent
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def _assets(heads: int, layers: int, rank: int) -> tuple[Path, Path]:
    """The transformer folder and the PEFT adapter folder (written once, seeded)."""
    import torch
    from diffusers import WanTransformer3DModel

    root = REPO / ".cache" / "bench_assets" / f"wan_h{heads}_l{layers}"
    model_dir, lora_dir = root / "transformer", root / f"lora_r{rank}"
    if not (model_dir / "config.json").is_file():
        torch.manual_seed(0)
        dim = 128 * heads
        WanTransformer3DModel(
            num_attention_heads=heads,
            attention_head_dim=128,
            text_dim=256,
            freq_dim=256,
            ffn_dim=int(dim * 2.7),
            num_layers=layers,
            rope_max_seq_len=256,
        ).save_pretrained(model_dir, safe_serialization=True)
    write_random_adapter(WanTransformer3DModel, model_dir, lora_dir, rank, TARGETS)
    return model_dir, lora_dir


def run(args) -> dict:
    import torch
    from diffusers import WanTransformer3DModel as Reference

    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
    from vllm_omni.diffusion.models.wan import WanTransformer3DModel

    torch.set_num_threads(1)
    model_dir, lora_dir = _assets(args.heads, args.layers, args.rank)
    init_diffusion_parallel_state(1, 0)
    ours = WanTransformer3DModel.from_pretrained(model_dir)
    ref = Reference.from_pretrained(str(model_dir)).eval()
    g = torch.Generator().manual_seed(0)
    latent_frames, side = (args.frames - 1) // 4 + 1, args.size // 8
    x = torch.randn(2, 16, latent_frames, side, side, generator=g)
    text = torch.randn(2, 512, 256, generator=g)
    t = torch.tensor([700.0, 700.0])
    result = compare(
        ours,
        lambda: ours(x, t, text),
        ref,
        lambda: ref(x, t, text, return_dict=False)[0],
        lora_dir,
        args.rank,
        args.repeats,
    )
    return {"config": vars(args) | {"tokens_per_sample": latent_frames * (side // 2) ** 2}, **result}


def compile_check() -> dict:
    """Final latents of the compiled stage vs the eager one (see the module docstring)."""
    import os
    import time

    from tools.make_tiny_wan import ensure_tiny_wan, ensure_tiny_wan_loras
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.lora.request import LoRARequest

    assets = os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO / ".cache" / "test_assets"
    model_dir = ensure_tiny_wan(assets, moe=True)
    files = ensure_tiny_wan_loras(assets)
    pair = [LoRARequest("high", 1, str(files["high"])), LoRARequest("low", 2, str(files["low"]))]
    sp = OmniDiffusionSamplingParams(
        height=32,
        width=48,
        num_inference_steps=4,
        guidance_scale=3.0,
        seed=5,
        output_type="latent",
        extra_args={"num_frames": 5},
    )
    cases = {
        "base": {},
        "pair": {"lora_requests": pair},
        "pair_scaled": {"lora_requests": pair, "lora_scales": [0.5, 1.0]},
    }
    runs, walls = {}, {}
    for eager in (True, False):
        start = time.perf_counter()
        with Omni(
            str(model_dir), max_loras=2, dtype="float32", enforce_eager=eager, enable_progress_bar=False
        ) as omni:
            runs[eager] = {
                name: omni.generate(["a red cat"], sp, **kw)[0].latents for name, kw in cases.items()
            }
        walls["eager_s" if eager else "compiled_s"] = time.perf_counter() - start
    diffs = {name: (runs[True][name] - runs[False][name]).abs().max().item() for name in cases}
    return {"compiled_vs_eager_max_abs": diffs, **walls}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="dim 256, 2 blocks, 5 frames, 64 px, 3 repeats")
    p.add_argument("--heads", type=int, default=4, help="attention heads of 128 channels (dim = 128 x heads)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--frames", type=int, default=9, help="video frames (1 + 4k)")
    p.add_argument("--size", type=int, default=128, help="frame side in pixels (multiple of 16)")
    add_common_flags(p)
    p.add_argument("--compile-check", action="store_true", help="compiled stage vs eager on the tiny model")
    args = p.parse_args(argv)
    if args.quick:
        args.heads, args.layers, args.frames, args.size, args.repeats = 2, 2, 5, 64, 3
    return emit(compile_check() if args.compile_check else run(args), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
