"""Throughput of a diffusion stage with 2 replicas against 1, measured side by side in one run.

Each side is one ``Omni`` on the tiny Z-Image (float32, CPU) in its own process, kept up for the
whole run; the parent asks the sides in turn (alternating the order) for one burst of
``--requests`` requests (every other one with a PEFT adapter), so both sides see the same machine
state. The sides:

* ``1x2``: 1 replica, torch with 2 intra-op threads (the whole machine, the usual setting);
* ``2x1``: 2 in-process replicas (``replicas=2``), torch with 1 intra-op thread, so 2 replicas x 1
  thread use the same 2 cores; the burst is spread by least-loaded dispatch, each replica batching
  its share on its own driver thread;
* ``1x1``: 1 replica with 1 thread, for reference (what one replica of ``2x1`` could do alone).

Before timing, the parent checks that every side returns the same latents for the burst.
Reported: median wall seconds per burst, requests/s, and the median of the per-round ratios of
``2x1`` (and ``1x1``) throughput over ``1x2``.

Run from the repository root::

    .venv/bin/python -m benchmarks.replicas [--repeats 15] [--json benchmarks/results/replicas.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.llm_overhead import _TAG, _busy_jiffies, _Side

REPO = Path(__file__).resolve().parent.parent
SIDES = {"1x2": (1, 2), "2x1": (2, 1), "1x1": (1, 1)}  # name -> (replicas, torch threads per process)
PROMPTS = ["a red cat on a mat", "a blue house by the sea", "two birds on a wire", "a green tree in fog"]


def _assets() -> tuple[str, str]:
    sys.path.insert(0, str(REPO))
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets
    from tools.make_tiny_diffusion_lora import ensure_tiny_z_image_loras

    root = Path(os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO / ".cache" / "test_assets")
    model = ensure_tiny_diffusion_assets(root)["z_image"]
    return str(model), str(ensure_tiny_z_image_loras(model, root)["attn"])


def serve_side(side: str, args) -> None:
    """Child mode: one ``Omni`` for ``side``; ``run`` times one burst, ``sums`` returns its latents' sums."""
    import torch

    replicas, threads = SIDES[side]
    torch.set_num_threads(threads)  # before any engine thread starts: every driver thread takes it
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.lora.request import LoRARequest

    model, adapter = _assets()
    omni = Omni(model=model, dtype="float32", enable_progress_bar=False, replicas=replicas, max_loras=1)
    lora = LoRARequest("attn", 1, adapter)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    loras = [lora if i % 2 == 0 else None for i in range(args.requests)]
    params = OmniDiffusionSamplingParams(
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        guidance_scale=3.0,
        seed=7,
        output_type="latent",
    )

    def burst():
        return omni.generate(prompts, params, lora_request=loras)

    burst()  # warm-up: adapter loads, first-call costs
    print(_TAG + "READY", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd == "sums":
            print(_TAG + "S " + json.dumps([o.latents.double().sum().item() for o in burst()]), flush=True)
            continue
        t0 = time.perf_counter()
        burst()
        print(f"{_TAG}T {time.perf_counter() - t0!r}", flush=True)
    omni.shutdown()


def measure(args) -> dict[str, list[float]]:
    """Start every side, check they agree, then alternate bursts; ``{side: [seconds ...]}``."""
    child = [sys.executable, "-m", "benchmarks.replicas", "--requests", str(args.requests)]
    child += ["--size", str(args.size), "--steps", str(args.steps)]
    env = dict(os.environ)
    sides = {}
    try:
        for name in SIDES:  # one at a time: each start loads a model
            sides[name] = _Side(child + ["--side", name], env)
        sums = {}
        for name, s in sides.items():
            s.proc.stdin.write("sums\n")
            s.proc.stdin.flush()
            sums[name] = json.loads(s._expect("S"))
        ref = sums["1x2"]
        for name, got in sums.items():
            err = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got, ref))
            if err > 1e-4:
                raise SystemExit(
                    f"side {name} returns other latents than 1x2 (relative error of sums {err:.2e})"
                )
        samples: dict[str, list[float]] = {name: [] for name in SIDES}
        for rep in range(args.repeats):
            order = list(SIDES) if rep % 2 == 0 else list(reversed(SIDES))
            for name in order:
                samples[name].append(sides[name].time("run"))
        return samples
    finally:
        for s in sides.values():
            s.close()


def summarize(samples: dict[str, list[float]], requests: int) -> dict[str, dict[str, float]]:
    base = samples["1x2"]
    rows = {}
    for name, times in samples.items():
        rows[name] = {
            "replicas": SIDES[name][0],
            "torch_threads": SIDES[name][1],
            "burst_s_median": statistics.median(times),
            "burst_s_min": min(times),
            "requests_per_s": requests / statistics.median(times),
            # throughput ratio against 1x2, per round (the two bursts ran seconds apart)
            "throughput_vs_1x2": statistics.median(b / t for b, t in zip(base, times)),
            "samples_s": times,
        }
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8, help="requests per burst")
    p.add_argument("--size", type=int, default=256, help="image height and width (multiple of 16)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15, help="timed bursts per side")
    p.add_argument("--json", default="benchmarks/results/replicas.json")
    p.add_argument("--side", choices=list(SIDES), help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.side:
        serve_side(args.side, args)
        return 0
    load_before, busy0, t0 = os.getloadavg(), _busy_jiffies(), time.monotonic()
    samples = measure(args)
    load_after, busy1, wall = os.getloadavg(), _busy_jiffies(), time.monotonic() - t0
    rows = summarize(samples, args.requests)
    print(
        f"\nDiffusion stage replicas (tiny Z-Image {args.size}x{args.size}, {args.steps} steps, CFG, "
        f"{args.requests} requests per burst, half with an adapter; {args.repeats} bursts per side, alternating)"
    )
    print(f"{'side':<6}{'replicas':>9}{'threads':>8}{'burst s':>9}{'req/s':>8}{'vs 1x2':>8}")
    for name, r in rows.items():
        print(
            f"{name:<6}{r['replicas']:>9}{r['torch_threads']:>8}{r['burst_s_median']:>9.3f}"
            f"{r['requests_per_s']:>8.2f}{r['throughput_vs_1x2']:>8.3f}"
        )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "wall_s": wall,
    }
    if busy0 is not None and busy1 is not None:
        machine["machine_busy_cores_avg"] = (busy1 - busy0) / os.sysconf("SC_CLK_TCK") / wall
    out = {"args": {k: v for k, v in vars(args).items() if k != "side"}, "machine": machine, "sides": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
