"""Omni's own overhead on an LLM stage, measured against raw ``vllm.LLM`` in one run.

Both sides serve the same prompts with the same weights and the same engine options
(in-process engines, greedy decoding, fixed output length). Reported as ratios, so
they hold on a noisy machine:

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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up (adapter loads, first-request costs)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--adapters", nargs="*")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="benchmarks/results/llm_overhead.json")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from vllm import LLM, SamplingParams

    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    if args.model is None:
        import sys

        sys.path.insert(0, str(REPO))
        from tools.make_tiny_llm import build_adapter, ensure_tiny_llm_assets

        assets = ensure_tiny_llm_assets(REPO / ".cache" / "test_assets")
        model = str(assets.model_dir)
        adapters = [str(assets.adapter_a), str(assets.adapter_b)]
        for i in (3, 4):
            out = REPO / ".cache" / "test_assets" / f"bench_adapter_{i}"
            if not (out / "adapter_config.json").exists():
                build_adapter(
                    model, out, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=100 + i
                )
            adapters.append(str(out))
    else:
        model, adapters = args.model, args.adapters or []
    if len(adapters) < 4:
        raise SystemExit("need 4 adapters (--adapters A B C D)")

    opts = dict(enable_lora=True, max_lora_rank=16, max_loras=4, max_model_len=512, dtype="float32")
    prompts = [f"prompt number {i} about the quick brown fox" for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    loras = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters[:4])]

    llm = LLM(model=model, **opts)
    omni = Omni(model, **opts)
    try:
        rows = {}
        for label, lora in (("no adapter", None), ("one adapter", loras[0])):
            t_llm = _timed(
                lambda lora=lora: llm.generate(prompts, params, lora_request=lora, use_tqdm=False),
                args.repeats,
            )
            t_omni = _timed(
                lambda lora=lora: omni.generate(prompts, params, lora_request=lora, use_tqdm=False),
                args.repeats,
            )
            rows[label] = {"vllm_LLM_s": t_llm, "omni_s": t_omni, "ratio": t_omni / t_llm}
        per_prompt = [loras[i % 4] for i in range(len(prompts))]
        t1 = _timed(
            lambda: omni.generate(prompts, params, lora_request=loras[0], use_tqdm=False), args.repeats
        )
        t4 = _timed(
            lambda: omni.generate(prompts, params, lora_request=per_prompt, use_tqdm=False), args.repeats
        )
        tokens = len(prompts) * args.max_tokens
        rows["4 adapters vs 1 in flight (ours)"] = {
            "1_adapter_tok_s": tokens / t1,
            "4_adapters_tok_s": tokens / t4,
            "ratio": t4 / t1,
        }
    finally:
        omni.shutdown()

    print(
        f"\nLLM stage overhead ({len(prompts)} prompts x {args.max_tokens} tokens, median of {args.repeats})"
    )
    print(f"{'case':<36}{'vllm.LLM s':>12}{'Omni s':>10}{'ratio':>8}")
    for label, r in rows.items():
        if "vllm_LLM_s" in r:
            print(f"{label:<36}{r['vllm_LLM_s']:>12.3f}{r['omni_s']:>10.3f}{r['ratio']:>8.3f}")
        else:
            print(
                f"{label:<36}{r['1_adapter_tok_s']:>10.0f} tok/s (1) {r['4_adapters_tok_s']:>8.0f} tok/s (4)  ratio {r['ratio']:.3f}"
            )
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "command": "python -m benchmarks.llm_overhead " + " ".join(argv or []),
        "model": model,
        "results": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
