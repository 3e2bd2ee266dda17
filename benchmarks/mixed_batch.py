"""Mixed LoRA batches on an LLM stage: alternating adapter / no-adapter requests vs uniform ones.

One ``Omni`` (engine in-process, float32, ``max_loras=2``) serves, in one run and interleaved
call by call, ``--requests`` requests of ``--tokens`` greedy tokens each:

* ``alternating``: adapter a, none, adapter b, none, ... in one ``generate`` call;
* ``uniform``: the same prompts, every request with an adapter (a, b, a, b, ...);
* ``separated``: the alternating requests run as two calls (adapter ones, then the others), which is
  what keeping the two kinds out of one batch costs (the mixed-batch guard this replaced).

Reported: the median wall time and process CPU time per case, and the median of the per-pair
ratios alternating / uniform (goal <= 1.2) and separated / uniform. Before timing, every
alternating output is checked against transformers+peft (``tests/llm_reference.py``).

Run from the repository root::

    .venv/bin/python -m benchmarks.mixed_batch [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["hello world", "the quick brown fox", "a b c", "one two three four"]


def _requests(n: int, adapters: list, alternating: bool) -> tuple[list[str], list]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    if alternating:
        loras = [adapters[(i // 2) % 2] if i % 2 == 0 else None for i in range(n)]
    else:
        loras = [adapters[i % 2] for i in range(n)]
    return prompts, loras


def _timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def _check_parity(omni, assets, prompts, loras, params, tokens: int) -> None:
    from tests.llm_reference import hf_greedy

    outs = omni.generate(prompts, params, lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs):
        ref = hf_greedy(assets.model_dir, prompt, tokens, None if lora is None else lora.lora_path)
        if out.token_ids != ref:
            raise SystemExit(f"mismatch vs transformers+peft: {prompt!r} adapter={lora and lora.lora_name}")


def run(requests: int, tokens: int, repeats: int) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(REPO))
    from vllm import SamplingParams

    from tools.make_tiny_llm import ensure_tiny_llm_assets
    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    assets = ensure_tiny_llm_assets(
        os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO / ".cache" / "test_assets"
    )
    adapters = [
        LoRARequest("a", 1, str(assets.adapter_a)),
        LoRARequest("b", 2, str(assets.adapter_b)),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    alt_prompts, alt_loras = _requests(requests, adapters, alternating=True)
    uni_prompts, uni_loras = _requests(requests, adapters, alternating=False)
    with_idx = [i for i, lora in enumerate(alt_loras) if lora is not None]
    without_idx = [i for i, lora in enumerate(alt_loras) if lora is None]
    cases = {
        "alternating": lambda: omni.generate(alt_prompts, params, lora_request=alt_loras),
        "uniform": lambda: omni.generate(uni_prompts, params, lora_request=uni_loras),
        "separated": lambda: (
            omni.generate(
                [alt_prompts[i] for i in with_idx], params, lora_request=[alt_loras[i] for i in with_idx]
            ),
            omni.generate([alt_prompts[i] for i in without_idx], params),
        ),
    }
    with Omni(
        str(assets.model_dir),
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        max_model_len=256,
        dtype="float32",
        max_num_seqs=max(8, requests),
    ) as omni:
        _check_parity(omni, assets, alt_prompts, alt_loras, params, tokens)
        for fn in cases.values():  # warm-up
            fn()
        wall = {name: [] for name in cases}
        cpu = {name: [] for name in cases}
        for _ in range(repeats):
            for name, fn in cases.items():
                w, c = _timed(fn)
                wall[name].append(w)
                cpu[name].append(c)
    med = statistics.median
    return {
        "requests": requests,
        "tokens": tokens,
        "repeats": repeats,
        "wall_s": {name: med(xs) for name, xs in wall.items()},
        "cpu_s": {name: med(xs) for name, xs in cpu.items()},
        "ratio_alternating_uniform": med(a / u for a, u in zip(wall["alternating"], wall["uniform"])),
        "ratio_separated_uniform": med(s / u for s, u in zip(wall["separated"], wall["uniform"])),
        "ratio_alternating_uniform_cpu": med(a / u for a, u in zip(cpu["alternating"], cpu["uniform"])),
        "parity_vs_transformers_peft": "equal",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = run(args.requests, args.tokens, args.repeats)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
