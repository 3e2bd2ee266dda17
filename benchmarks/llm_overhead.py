"""Omni's own overhead on an LLM stage, measured against raw ``vllm.LLM`` in one run.

Both sides serve the same prompts with the same weights and engine options (greedy,
fixed output length, engine in-process). Each side runs in its own process — two vLLM
engines in one process share torch's thread pool and vLLM's global state, which
distorts timings — but both processes stay up, and the parent asks them for one
``generate`` call at a time, alternating sides (``llm, omni, omni, llm, ...``). The two
sides of a pair therefore run a fraction of a second apart, on the same machine state:
on a shared or virtualised CPU, whose speed drifts by tens of percent from one minute
to the next, this is what makes the ratio mean something. ``--rounds`` starts that many
fresh pairs of processes. Reported, per case:

1. ``Omni`` / ``vllm.LLM`` wall time for a batch of prompts without an adapter and with
   one adapter (goal: <= 1.05): the median of the per-pair ratios (headline), the ratio
   of the medians and the ratio of the minimums;
2. throughput with 4 different adapters in flight vs 1 adapter (ours only).

Run from the repository root::

    .venv/bin/python -m benchmarks.llm_overhead [--model DIR --adapters A B C D] [--json out.json]

Without ``--model`` the tiny test model and adapters are built under ``.cache/test_assets``.
``--omni-src DIR`` imports ``vllm_omni`` from another checkout (compare two versions).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPTS = dict(enable_lora=True, max_lora_rank=16, max_loras=4, max_model_len=512, dtype="float32")
CASES = ("no adapter", "one adapter", "4 adapters in flight")
COMPARED = ("no adapter", "one adapter")  # the cases both sides run
_TAG = "@@bench "  # prefix of the child's protocol lines (vLLM may print to stdout too)


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


def serve_side(side: str, model: str, adapters: list[str], args) -> None:
    """Child mode: build one side's engine, then time one ``generate`` per line read from stdin.

    Each stdin line names a case (see ``CASES``); the answer is ``@@bench T <seconds>``.
    ``quit`` (or end of input) shuts the engine down.
    """
    if args.omni_src:
        sys.path.insert(0, args.omni_src)
    from vllm import SamplingParams

    from vllm_omni.lora.request import LoRARequest

    prompts = [f"prompt number {i} about the quick brown fox" for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    loras = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters[:4])]
    if side == "llm":
        from vllm import LLM

        engine = LLM(model=model, **OPTS)
    else:
        from vllm_omni import Omni

        engine = Omni(model, **OPTS)
        print(_TAG + "INFO vllm_omni from " + sys.modules["vllm_omni"].__file__, file=sys.stderr)
    lora_of = {
        "no adapter": None,
        "one adapter": loras[0],
        "4 adapters in flight": [loras[i % 4] for i in range(len(prompts))],
    }

    def gen(case: str) -> None:
        engine.generate(prompts, params, lora_request=lora_of[case], use_tqdm=False)

    for case in CASES if side == "omni" else COMPARED:
        gen(case)  # warm-up (adapter loads, first-request costs)
    print(_TAG + "READY", flush=True)
    for line in sys.stdin:
        case = line.strip()
        if case == "quit":
            break
        t0 = time.perf_counter()
        gen(case)
        print(f"{_TAG}T {time.perf_counter() - t0!r}", flush=True)
    if side == "omni":
        engine.shutdown()


class _Side:
    """One child process serving one side, answering one timed ``generate`` per request."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self._err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True
        )
        self._expect("READY")

    def _expect(self, what: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(_TAG + what):
                return line[len(_TAG) + len(what) :].strip()
        self._err.seek(0)
        raise RuntimeError(f"benchmark child {self.proc.args} exited:\n{self._err.read()[-4000:]}")

    def time(self, case: str) -> float:
        self.proc.stdin.write(case + "\n")
        self.proc.stdin.flush()
        return float(self._expect("T"))

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
        self._err.close()


def _busy_jiffies() -> int | None:
    """CPU time (all processes, jiffies) spent since boot, or ``None`` off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    return sum(v) - v[3] - v[4]  # minus idle and iowait


def measure(model: str, adapters: list[str], args) -> dict[str, dict[str, list[float]]]:
    """Alternate the two sides call by call; returns ``{side: {case: [seconds ...]}}``."""
    child = [sys.executable, "-m", "benchmarks.llm_overhead", "--model", model, "--adapters", *adapters]
    child += ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
    env = dict(os.environ)  # main() set the engine defaults (in-process engine, KV cache size)
    samples: dict[str, dict[str, list[float]]] = {"llm": {}, "omni": {}}
    for rnd in range(args.rounds):
        omni_src = ["--omni-src", args.omni_src] if args.omni_src else []
        sides = {
            "llm": _Side(child + ["--side", "llm"], env),
            "omni": _Side(child + ["--side", "omni"] + omni_src, env),
        }
        try:
            for rep in range(args.repeats):
                for case in CASES:
                    order = ["llm", "omni"] if (rep + rnd) % 2 == 0 else ["omni", "llm"]
                    for side in order:
                        if side == "llm" and case not in COMPARED:
                            continue
                        samples[side].setdefault(case, []).append(sides[side].time(case))
        finally:
            for s in sides.values():
                s.close()
    return samples


def summarize(samples: dict[str, dict[str, list[float]]], args) -> dict[str, dict[str, float]]:
    """Ratios per compared case (median/median, median of pairs, min/min) and the adapter throughput row."""
    rows: dict[str, dict[str, float]] = {}
    for case in COMPARED:
        llm, omni = samples["llm"][case], samples["omni"][case]
        rows[case] = {
            "vllm_LLM_s": statistics.median(llm),
            "omni_s": statistics.median(omni),
            # headline: each pair ran a fraction of a second apart, so machine drift cancels
            "ratio": statistics.median(o / ref for o, ref in zip(omni, llm)),
            "ratio_of_medians": statistics.median(omni) / statistics.median(llm),
            "vllm_LLM_min_s": min(llm),
            "omni_min_s": min(omni),
            "min_ratio": min(omni) / min(llm),
        }
    tokens = args.num_prompts * args.max_tokens
    t1 = statistics.median(samples["omni"]["one adapter"])
    t4 = statistics.median(samples["omni"]["4 adapters in flight"])
    rows["4 adapters vs 1 in flight (ours)"] = {
        "1_adapter_tok_s": tokens / t1,
        "4_adapters_tok_s": tokens / t4,
        "ratio": t4 / t1,
    }
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--adapters", nargs="*")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=15, help="timed calls per side and case in each round")
    p.add_argument("--rounds", type=int, default=2, help="fresh pairs of processes")
    p.add_argument("--omni-src", help="import vllm_omni from this checkout instead")
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
        serve_side(args.side, model, adapters, args)
        return 0

    load_before, busy0, t0 = os.getloadavg(), _busy_jiffies(), time.monotonic()
    samples = measure(model, adapters, args)
    load_after, busy1, wall = os.getloadavg(), _busy_jiffies(), time.monotonic() - t0
    rows = summarize(samples, args)

    print(
        f"\nLLM stage overhead ({args.num_prompts} prompts x {args.max_tokens} tokens, {args.rounds} rounds x "
        f"{args.repeats} calls per side and case, sides alternating call by call in two live processes)"
    )
    print(f"{'case':<30}{'vllm.LLM s':>11}{'Omni s':>9}{'ratio':>8}{'med/med':>9}{'min/min':>9}")
    for label, r in rows.items():
        if "vllm_LLM_s" in r:
            print(
                f"{label:<30}{r['vllm_LLM_s']:>11.4f}{r['omni_s']:>9.4f}{r['ratio']:>8.3f}"
                f"{r['ratio_of_medians']:>9.3f}{r['min_ratio']:>9.3f}"
            )
        else:
            print(
                f"{label:<30}{r['1_adapter_tok_s']:>8.0f} tok/s (1) {r['4_adapters_tok_s']:>8.0f} tok/s (4)"
                f"  ratio {r['ratio']:.3f}"
            )
    print(
        "ratio = median of per-pair Omni/LLM ratios (goal <= 1.05); med/med, min/min: of all calls per side"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_before": load_before,
        "load_average_after": load_after,
    }
    if busy0 is not None and busy1 is not None:
        # CPU the whole machine spent during the run, in cores: ~2 means both sides' threads only
        machine["busy_cores_during_run"] = (busy1 - busy0) / os.sysconf("SC_CLK_TCK") / wall
    result = {
        "machine": machine,
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
