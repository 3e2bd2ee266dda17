"""Omni's own overhead on an LLM stage, measured against raw ``vllm.LLM`` in one run.

Both sides serve the same prompts with the same weights and engine options (greedy,
fixed output length, engine in-process). Each side runs in its own fresh process — two
vLLM engines in one process share torch's thread pool and vLLM's global state, which
distorts timings — and the sides alternate for ``--rounds`` rounds; medians are
compared. Reported as ratios, so they hold on a noisy machine:

1. ``Omni`` / ``vllm.LLM`` wall time for a batch of prompts without an adapter and with
   one adapter (goal: <= 1.05);
2. throughput with 4 different adapters in flight vs 1 adapter (ours only).

Run from the repository root::

    .venv/bin/python -m benchmarks.llm_overhead [--model DIR --adapters A B C D] [--json out.json]

Without ``--model`` the tiny test model and adapters are built under ``.cache/test_assets``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPTS = dict(enable_lora=True, max_lora_rank=16, max_loras=4, max_model_len=512, dtype="float32")


def _timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up (adapter loads, first-request costs)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def _default_assets() -> tuple[str, list[str]]:
    sys.path.insert(0, str(REPO))
    from tools.make_tiny_llm import build_adapter, ensure_tiny_llm_assets

    assets = ensure_tiny_llm_assets(REPO / ".cache" / "test_assets")
    model = str(assets.model_dir)
    adapters = [str(assets.adapter_a), str(assets.adapter_b)]
    for i in (3, 4):
        out = REPO / ".cache" / "test_assets" / f"bench_adapter_{i}"
        if not (out / "adapter_config.json").exists():
            build_adapter(model, out, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=100 + i)
        adapters.append(str(out))
    return model, adapters


def run_side(side: str, model: str, adapters: list[str], args) -> dict[str, list[float]]:
    """Time one side (``llm`` or ``omni``) in this process; returns samples per case."""
    from vllm import SamplingParams

    from vllm_omni.lora.request import LoRARequest

    prompts = [f"prompt number {i} about the quick brown fox" for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    loras = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters[:4])]
    if side == "llm":
        from vllm import LLM

        engine = LLM(model=model, **OPTS)

        def gen(lora):
            return engine.generate(prompts, params, lora_request=lora, use_tqdm=False)
    else:
        from vllm_omni import Omni

        engine = Omni(model, **OPTS)

        def gen(lora):
            return engine.generate(prompts, params, lora_request=lora, use_tqdm=False)

    out = {
        "no adapter": _timed(lambda: gen(None), args.repeats),
        "one adapter": _timed(lambda: gen(loras[0]), args.repeats),
    }
    if side == "omni":
        per_prompt = [loras[i % 4] for i in range(len(prompts))]
        out["4 adapters in flight"] = _timed(lambda: gen(per_prompt), args.repeats)
        engine.shutdown()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--adapters", nargs="*")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two sides (fresh process each)")
    p.add_argument("--json", default="benchmarks/results/llm_overhead.json")
    p.add_argument("--side", choices=["llm", "omni"], help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    if args.model is None:
        model, adapters = _default_assets()
    else:
        model, adapters = args.model, args.adapters or []
    if len(adapters) < 4:
        raise SystemExit("need 4 adapters (--adapters A B C D)")
    if args.side:
        print("RESULT " + json.dumps(run_side(args.side, model, adapters, args)))
        return 0

    samples: dict[str, dict[str, list[float]]] = {"llm": {}, "omni": {}}
    child = [sys.executable, "-m", "benchmarks.llm_overhead", "--model", model, "--adapters", *adapters]
    child += ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
    child += ["--repeats", str(args.repeats)]
    for _ in range(args.rounds):
        for side in ("llm", "omni"):
            proc = subprocess.run(
                child + ["--side", side], cwd=REPO, capture_output=True, text=True, check=True
            )
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
            for case, values in json.loads(line[7:]).items():
                samples[side].setdefault(case, []).extend(values)

    med = {side: {case: statistics.median(v) for case, v in cases.items()} for side, cases in samples.items()}
    rows = {
        case: {
            "vllm_LLM_s": med["llm"][case],
            "omni_s": med["omni"][case],
            "ratio": med["omni"][case] / med["llm"][case],
        }
        for case in ("no adapter", "one adapter")
    }
    tokens = args.num_prompts * args.max_tokens
    t1, t4 = med["omni"]["one adapter"], med["omni"]["4 adapters in flight"]
    rows["4 adapters vs 1 in flight (ours)"] = {
        "1_adapter_tok_s": tokens / t1,
        "4_adapters_tok_s": tokens / t4,
        "ratio": t4 / t1,
    }

    print(
        f"\nLLM stage overhead ({args.num_prompts} prompts x {args.max_tokens} tokens, "
        f"median of {args.rounds} x {args.repeats} runs per side, each side in a fresh process)"
    )
    print(f"{'case':<36}{'vllm.LLM s':>12}{'Omni s':>10}{'ratio':>8}")
    for label, r in rows.items():
        if "vllm_LLM_s" in r:
            print(f"{label:<36}{r['vllm_LLM_s']:>12.3f}{r['omni_s']:>10.3f}{r['ratio']:>8.3f}")
        else:
            print(
                f"{label:<36}{r['1_adapter_tok_s']:>8.0f} tok/s (1) {r['4_adapters_tok_s']:>8.0f} tok/s (4)  ratio {r['ratio']:.3f}"
            )
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
        },
        "command": "python -m benchmarks.llm_overhead "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": model,
        "results": rows,
        "samples": samples,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
