"""Diffusion serving under open-loop arrivals: step-level batching vs whole-request batching (issue 48).

Two stages on the same model run in this process, one with ``batching="step"`` and one with
``batching="request"`` (both ``max_batch_size`` 8, ``max_loras`` 1, float32, ``--threads`` intra-op
threads, default 1). Each serves the same requests, taking turns per pattern (the order alternating by
round), so a change in the machine's load hits both alike:

* requests alternate long (``--long-steps``, 32) and short (``--short-steps``, 4, with the demo's
  ``warm`` adapter: a Lightning-like distilled request) and use CFG (guidance 3), each with its own seed;
* ``fixed``: one request every quarter of a long request's time alone (``T_long``, measured on the
  request-batching stage at the start of every round); ``poisson``: exponential gaps with the same mean
  (seeded by the round);
* ``saturated``: every request queued at once (throughput: requests per second until the last one).

Latency is from a request's arrival to its result. Reported per pattern and mode: mean / p50 / p90
latency of all requests and of the short ones, and throughput (medians over rounds); then the ratios
step / request (per round, the two modes back to back, and their median), and the ratio of the process's
CPU seconds for the same requests (the work each mode does, which a shared machine's load hardly moves). Before
timing, the first request of each kind is checked: the step stage's latents equal the request stage's
(within 1e-5). The 1-minute load average is printed with the figures (a shared machine slows both).

Run from the repository root::

    .venv/bin/python -m benchmarks.diffusion_serving [--requests 8] [--rounds 1] [--size 256]
        [--json benchmarks/results/diffusion_serving.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "examples" / "demo_model"
PROMPTS = ["a red circle", "a blue square", "a green triangle", "a yellow circle"]


def _requests(args, adapter) -> list[tuple[str, object, object]]:
    """``(kind, StageRequest, ...)``: long and short requests alternating, long first."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.inputs.stage_request import StageRequest
    from vllm_omni.lora.request import NO_ADAPTERS, RequestAdapters

    out = []
    for i in range(args.requests):
        long = i % 2 == 0
        params = OmniDiffusionSamplingParams(
            height=args.size,
            width=args.size,
            num_inference_steps=args.long_steps if long else args.short_steps,
            guidance_scale=3.0,
            seed=1000 + i,
            output_type=args.output_type,
        )
        ads = NO_ADAPTERS if long else RequestAdapters.of(adapter)
        out.append(("long" if long else "short", StageRequest(PROMPTS[i % len(PROMPTS)], params, ads)))
    return out


def _serve(stage, requests, gaps: list[float]) -> dict:
    """Submit ``requests`` open loop (request ``i`` at ``sum(gaps[:i+1])`` seconds); per request its
    kind and latency (arrival to result), and the seconds until the last result."""
    done = threading.Event()
    results: list[tuple[str, float]] = [None] * len(requests)  # type: ignore[list-item]
    left = [len(requests)]
    lock = threading.Lock()
    start, cpu_start = time.perf_counter(), time.process_time()
    arrival = 0.0
    # all at once: queued together (a submitting thread competes with the driver for the GIL)
    held = stage.hold() if not any(gaps) else contextlib.nullcontext()
    held.__enter__()
    for i, ((kind, request), gap) in enumerate(zip(requests, gaps, strict=True)):
        arrival += gap
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        arrived = time.perf_counter()
        fut = stage.submit(request)

        def finished(f, i=i, kind=kind, arrived=arrived):
            f.result()  # a failure is a benchmark error
            with lock:
                results[i] = (kind, time.perf_counter() - arrived)
                left[0] -= 1
                if not left[0]:
                    done.set()

        fut.add_done_callback(finished)
    held.__exit__(None, None, None)
    done.wait()
    return {
        "latencies": results,
        "makespan": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu_start,
    }


def _summary(run: dict) -> dict:
    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {
            "mean": statistics.fmean(xs),
            "p50": statistics.median(xs),
            "p90": xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))],
        }

    lat = run["latencies"]
    return {
        "all": stats([t for _, t in lat]),
        "short": stats([t for k, t in lat if k == "short"]),
        "long": stats([t for k, t in lat if k == "long"]),
        "throughput": len(lat) / run["makespan"],
        "cpu_s": run["cpu_s"],
    }


def _check_equal(stages: dict, requests) -> None:
    import torch

    for kind in ("long", "short"):
        _, request = next(r for r in requests if r[0] == kind)
        req = dataclasses.replace(request, params=dataclasses.replace(request.params, output_type="latent"))
        a, b = (stages[m].submit(req).result().latents for m in ("step", "request"))
        if not torch.allclose(a, b, atol=1e-5, rtol=1e-5):
            raise SystemExit(f"{kind} request: step-batched latents differ from request-batched ones")


def run(args) -> dict:
    import torch

    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    torch.set_num_threads(args.threads)
    common = dict(dtype="float32", enable_progress_bar=False, max_batch_size=args.max_batch_size, max_loras=1)
    omnis = {mode: Omni(model=str(DEMO), batching=mode, **common) for mode in ("step", "request")}
    stages = {mode: o._orchestrator.runtimes[0] for mode, o in omnis.items()}
    try:
        adapter = LoRARequest("warm", 1, str(DEMO / "adapters" / "warm"))
        requests = _requests(args, adapter)
        _check_equal(stages, requests)
        rows: dict[str, dict[str, list[dict]]] = {
            p: {"step": [], "request": []} for p in ("fixed", "poisson", "saturated")
        }
        loads, t_longs = [], []
        for round_ in range(args.rounds):
            # T_long per round (least disturbed of two): the machine's load drifts over minutes
            long_alone = []
            for _ in range(2):
                t0 = time.perf_counter()
                stages["request"].submit(requests[0][1]).result()
                long_alone.append(time.perf_counter() - t0)
            t_longs.append(min(long_alone))
            gap = t_longs[-1] / 4
            rng = random.Random(round_)
            patterns = {
                "fixed": [0.0] + [gap] * (len(requests) - 1),
                "poisson": [0.0] + [rng.expovariate(1 / gap) for _ in range(len(requests) - 1)],
                "saturated": [0.0] * len(requests),
            }
            order = ("request", "step") if round_ % 2 == 0 else ("step", "request")
            for pattern, gaps in patterns.items():
                for mode in order:
                    loads.append(os.getloadavg()[0])
                    rows[pattern][mode].append(_summary(_serve(stages[mode], requests, gaps)))
                    print(
                        f"  round {round_} T_long {t_longs[-1]:.2f} s {pattern:9s} {mode:7s} done "
                        f"(load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
    finally:
        for o in omnis.values():
            o.shutdown()

    def med(items: list[dict], *keys) -> float:
        vals = []
        for item in items:
            for k in keys:
                item = item[k]
            vals.append(item)
        return statistics.median(vals)

    report = {
        "t_long_alone_s": t_longs,
        "requests": args.requests,
        "size": args.size,
        "steps": [args.long_steps, args.short_steps],
        "load_avg_1m": [min(loads), max(loads)],
        "threads": args.threads,
        "patterns": {},
    }
    print(
        f"\nT_long alone {', '.join(f'{t:.2f}' for t in t_longs)} s (per round); arrivals every T_long / 4 "
        "(fixed) or Poisson with that mean; "
        f"{args.requests} requests, {args.size}x{args.size}; load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print(
        f"{'pattern':9s} {'mode':7s} {'mean':>7s} {'p50':>7s} {'p90':>7s} {'short mean':>10s} {'req/s':>7s}"
    )
    for pattern, by_mode in rows.items():
        out = {}
        for mode in ("request", "step"):
            r = by_mode[mode]
            out[mode] = {
                "all": {k: med(r, "all", k) for k in ("mean", "p50", "p90")},
                "short": {k: med(r, "short", k) for k in ("mean", "p50", "p90")},
                "long": {k: med(r, "long", k) for k in ("mean", "p50", "p90")},
                "throughput": med(r, "throughput"),
                "cpu_s": med(r, "cpu_s"),
                "rounds": r,
            }
            a = out[mode]
            print(
                f"{pattern:9s} {mode:7s} {a['all']['mean']:7.2f} {a['all']['p50']:7.2f} {a['all']['p90']:7.2f} "
                f"{a['short']['mean']:10.2f} {a['throughput']:7.3f}"
            )
        # per round (the two modes ran back to back), then the median over rounds
        pairs = list(zip(by_mode["step"], by_mode["request"], strict=True))
        out["ratios"] = {
            "short_mean": statistics.median(s["short"]["mean"] / q["short"]["mean"] for s, q in pairs),
            "all_mean": statistics.median(s["all"]["mean"] / q["all"]["mean"] for s, q in pairs),
            "throughput": statistics.median(s["throughput"] / q["throughput"] for s, q in pairs),
            "cpu": statistics.median(s["cpu_s"] / q["cpu_s"] for s, q in pairs),
        }
        r = out["ratios"]
        print(
            f"{pattern:9s} step/request: short mean {r['short_mean']:.2f}x, all mean {r['all_mean']:.2f}x, "
            f"throughput {r['throughput']:.2f}x, process CPU seconds {r['cpu']:.2f}x"
        )
        report["patterns"][pattern] = out
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--requests", type=int, default=8, help="requests per pattern (long and short alternating)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeats of every pattern and mode (medians)")
    parser.add_argument("--size", type=int, default=256, help="image side in pixels")
    parser.add_argument("--long-steps", type=int, default=32)
    parser.add_argument("--short-steps", type=int, default=4)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared machine)"
    )
    parser.add_argument(
        "--output-type", default="pil", choices=("pil", "latent"), help="'latent': no VAE decode"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report = run(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
