"""Cost of LoRA scale schedules: per-step time with a schedule vs a constant scale, same weights, one run.

The model and adapters are those of :mod:`benchmarks.diffusion_lora` (a random Z-Image transformer in
diffusers format, PEFT adapters of rank ``--rank`` on every block's projections), run by the in-tree
``ZImageTransformer2DModel`` + ``DiffusionLoRAManager``. A "run" is ``--steps`` denoiser forwards, each
inside ``denoising_step(i, steps)`` exactly as the Z-Image pipeline's loop does; per case we time whole
runs (so a schedule pays its re-publication at every step) and report seconds per step.

Cases (interleaved inside every repeat, in reversed order every other repeat, so a change of the
machine's load or a position effect hits them alike):

* ``constant``: one adapter at scale 0.8 (the baseline);
* ``per_step``: the same adapter with a different scale at every step (a list);
* ``ranges_blocks``: step-fraction ranges and block multipliers (``layers.0`` x0.5, the refiners x0);
* ``composed_constant`` / ``composed_schedule``: two adapters, constant vs one scheduled per step;
* ``mixed_constant`` / ``mixed_schedules``: a batch of 2 samples with different adapters, constant vs
  a different schedule per sample.

Reported: median seconds per step per case and the median of the per-repeat ratios schedule /
constant (goal <= 1.02). Before timing, each scheduled step is checked to equal (bit for bit) the
constant activation of that step's scale.

Run from the repository root::

    .venv/bin/python -m benchmarks.lora_schedule            # hidden 1024, 8+2+2 blocks, 1024 image tokens, fp32 CPU
    .venv/bin/python -m benchmarks.lora_schedule --quick    # small model, smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from benchmarks.diffusion_assets import ensure_adapter, ensure_transformer, model_config
from benchmarks.timing import Timer, median

REPO = Path(__file__).resolve().parent.parent
PAIRS = {
    "per_step": "constant",
    "ranges_blocks": "constant",
    "composed_schedule": "composed_constant",
    "mixed_schedules": "mixed_constant",
}


def _cases(steps: int, a, b) -> dict:
    """Per case ``(requests_per_sample, scales_per_sample, batch)``; schedules as parsed objects."""
    from vllm_omni.lora.schedule import LoRAScaleSchedule

    per_step = LoRAScaleSchedule.parse([0.8 - 0.05 * i for i in range(steps)])
    ranges = [{"start": 0.0, "end": 0.5, "scale": 1.0}, {"start": 0.5, "end": 1.0, "scale": 0.6}]
    blocks = LoRAScaleSchedule.parse({"steps": ranges, "blocks": {"layers.0": 0.5, "*refiner*": 0.0}})
    other = LoRAScaleSchedule.parse([0.3 + 0.05 * i for i in range(steps)])
    return {
        "constant": ([[a]], [[0.8]], 1),
        "per_step": ([[a]], [[per_step]], 1),
        "ranges_blocks": ([[a]], [[blocks]], 1),
        "composed_constant": ([[a, b]], [[0.8, 0.5]], 1),
        "composed_schedule": ([[a, b]], [[per_step, 0.5]], 1),
        "mixed_constant": ([[a], [b]], [[0.8], [0.5]], 2),
        "mixed_schedules": ([[a], [b]], [[per_step], [other]], 2),
    }


def _check(manager, run_steps, cases, steps: int) -> None:
    """Each scheduled step equals the constant activation of that step's scales: bit for bit, except
    composed adapters (a schedule scales the stacked ``A x`` rather than folding scales into ``A``)."""
    import torch

    from vllm_omni.lora.schedule import LoRAScaleSchedule

    for name in ("per_step", "composed_schedule", "mixed_schedules"):
        reqs, scales, batch = cases[name]
        with manager.activate(reqs, scales):
            got = run_steps(batch, steps, keep=True)
        for i in (0, steps - 1):
            fixed = [
                [v.scale_at(i, steps) if isinstance(v, LoRAScaleSchedule) else v for v in s] for s in scales
            ]
            with manager.activate(reqs, fixed):
                want = run_steps(batch, 1, keep=True, first=i)[0]
            tol = 0.0 if name != "composed_schedule" else 1e-5
            if not all(torch.allclose(g, w, rtol=0, atol=tol) for g, w in zip(got[i], want, strict=True)):
                raise SystemExit(f"{name}: step {i} differs from the constant activation of its scales")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model (dim 512, 4 layers, 256 tokens)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--refiner-layers", type=int, default=2)
    p.add_argument("--latent", type=int, default=64, help="latent H = W (image tokens = (latent/2)^2)")
    p.add_argument("--cap-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=8, help="denoising steps per timed run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU default 1)")
    p.add_argument("--assets", default=str(REPO / ".cache" / "bench_assets"))
    p.add_argument("--json", default="benchmarks/results/lora_schedule.json")
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.refiner_layers, args.latent, args.cap_tokens = 512, 4, 1, 32, 32
        args.repeats, args.steps = min(args.repeats, 3), min(args.steps, 4)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import torch

    torch.set_flush_denormal(True)
    on_cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    if args.threads or not on_cuda:
        torch.set_num_threads(args.threads or 1)
    timer = Timer(args.device, "wall" if on_cuda else "cpu")
    cfg = model_config(args.dim, args.layers, args.refiner_layers, cap_dim=512)
    folder = ensure_transformer(Path(args.assets), cfg)
    adir = folder.parent / "adapters"
    paths = [
        ensure_adapter(adir / f"r{args.rank}_{i}", cfg, args.rank, seed=1000 * args.rank + i) for i in (0, 1)
    ]

    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
    from vllm_omni.diffusion.forward_context import denoising_step, set_forward_context
    from vllm_omni.diffusion.lora import DiffusionLoRAManager
    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel
    from vllm_omni.lora.request import LoRARequest

    init_diffusion_parallel_state(world_size=1, rank=0)
    ours = ZImageTransformer2DModel.from_pretrained(folder, dtype=dtype, device=args.device)
    manager = DiffusionLoRAManager(ours, max_loras=2, max_rank=args.rank)
    a, b = (LoRARequest(pth.name, i + 1, str(pth)) for i, pth in enumerate(paths))
    gen = torch.Generator().manual_seed(0)
    xs = [
        torch.randn(16, 1, args.latent, args.latent, generator=gen).to(args.device, dtype) for _ in range(2)
    ]
    caps = [
        torch.randn(args.cap_tokens, cfg["cap_feat_dim"], generator=gen).to(args.device, dtype)
        for _ in range(2)
    ]
    ts = torch.tensor([0.3, 0.7], device=args.device)

    @torch.inference_mode()
    def run_steps(batch: int, n: int, keep: bool = False, first: int = 0):
        outs = []
        with set_forward_context():
            for i in range(first, first + n):
                with denoising_step(i, max(args.steps, first + n)):
                    out = ours(xs[:batch], ts[:batch], caps[:batch])
                if keep:
                    outs.append(out)
        return outs

    cases = _cases(args.steps, a, b)
    _check(manager, run_steps, cases, args.steps)
    print("scheduled steps equal the constant activation of their scales", flush=True)

    def timed(name: str) -> float:
        reqs, scales, batch = cases[name]
        with manager.activate(reqs, scales):
            return timer(lambda: run_steps(batch, args.steps)) / args.steps

    for name in cases:  # warm-up
        timed(name)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.repeats):
        order = list(cases) if rep % 2 == 0 else list(cases)[::-1]  # no case always runs first
        for name in order:
            samples[name].append(timed(name))
    ratios = {
        f"{case}/{base}": median([s / c for s, c in zip(samples[case], samples[base], strict=True)])
        for case, base in PAIRS.items()
    }
    result = {
        "config": {
            **{
                k: getattr(args, k)
                for k in ("dim", "layers", "refiner_layers", "latent", "cap_tokens", "rank")
            },
            **{k: getattr(args, k) for k in ("steps", "repeats", "device")},
            "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "clock": "wall" if on_cuda else "process cpu",
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "step_s": {name: median(vals) for name, vals in samples.items()},
        "ratio": ratios,
        "goal": "schedule / constant per step <= 1.02",
        "samples_s": samples,
    }
    text = json.dumps(result, indent=2)
    print(json.dumps({"step_s": result["step_s"], "ratio": ratios}, indent=2))
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
