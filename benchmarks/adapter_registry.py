"""Adapter registration and switch costs through ``Omni``: this tree against a baseline tree, in one run.

The adapter registry (``vllm_omni/lora/registry.py``) puts a fingerprint (a SHA-256 of the adapter's
files, re-read only when their inode, size or mtime changed) and a per-version identity in front of every
``add_lora`` and every request's adapter. This harness measures what that costs end to end, on the same
machine and in one run, against a checkout without it (``--baseline``, e.g. the merge base exported with
``git archive``):

* **registration**: ``add_lora`` then ``remove_lora`` of each of 4 PEFT adapters, median per call;
* **switch**: requests alternating between two registered adapters (diffusion: 1 step at 32x32; LLM: 2
  tokens), median latency per request; and a request without adapter for reference.

Both stages kinds are measured: the tiny Z-Image (diffusion) and the tiny Qwen2 (LLM, vLLM engine). Each
side runs in its own process (``--child``) whose ``PYTHONPATH`` is its tree; the parent alternates the
sides ``--rounds`` times and reports, per metric, the median of the per-round ratios this/baseline.
Separately, in this process: the fingerprint's throughput against parsing the same file with
safetensors (what a stage does when it loads the adapter).

Run from the repository root::

    git archive <base commit> | tar -x -C /tmp/base
    .venv/bin/python -m benchmarks.adapter_registry --baseline /tmp/base [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROUNDS_PER_CHILD = 8


def _assets() -> dict[str, str]:
    if str(REPO) not in sys.path:  # appended: a child's own tree (PYTHONPATH) must stay first
        sys.path.append(str(REPO))
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets
    from tools.make_tiny_diffusion_lora import ensure_tiny_z_image_loras
    from tools.make_tiny_llm import ensure_tiny_llm_assets

    root = Path(os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO / ".cache" / "test_assets")
    z_image = ensure_tiny_diffusion_assets(root)["z_image"]
    loras = ensure_tiny_z_image_loras(z_image, root)
    llm = ensure_tiny_llm_assets(root)
    out = {"z_image": str(z_image), "llm": str(llm.model_dir)}
    out.update({f"z_{k}": str(loras[k]) for k in ("attn", "qv", "ff", "embed")})
    out.update({"llm_a": str(llm.adapter_a), "llm_b": str(llm.adapter_b)})
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _measure(omni, adapters: list[str], request, base_request) -> dict[str, float]:
    """Registration and switch medians (seconds) on one engine."""
    from vllm_omni.lora.request import LoRARequest

    adds, removes = [], []
    for _ in range(ROUNDS_PER_CHILD):
        for i, path in enumerate(adapters):
            lora = LoRARequest(f"bench{i}", 500 + i, path)
            adds.append(_timed(lambda lora=lora: omni.add_lora(lora)))
            removes.append(_timed(lambda i=i: omni.remove_lora(500 + i)))
    pair = [LoRARequest("s0", 600, adapters[0]), LoRARequest("s1", 601, adapters[1])]
    for lora in pair:
        omni.add_lora(lora)
    for lora in pair:  # warm-up
        request(lora)
    switches = [_timed(lambda i=i: request(pair[i % 2])) for i in range(2 * ROUNDS_PER_CHILD)]
    base = [_timed(base_request) for _ in range(ROUNDS_PER_CHILD)]
    for lora in pair:
        omni.remove_lora(lora.lora_int_id)
    return {
        "add_s": statistics.median(adds),
        "remove_s": statistics.median(removes),
        "switch_request_s": statistics.median(switches),
        "base_request_s": statistics.median(base),
    }


def child(out: str) -> None:
    """One side: both stage kinds with this process's ``vllm_omni``; writes ``{kind: metrics}`` to ``out``."""
    import torch
    from vllm import SamplingParams

    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    torch.set_num_threads(1)
    a = _assets()
    result = {}
    with Omni(
        model=a["z_image"], dtype="float32", enable_progress_bar=False, max_loras=2, max_cpu_loras=8
    ) as omni:
        dp = OmniDiffusionSamplingParams(
            height=32, width=32, num_inference_steps=1, guidance_scale=1.0, seed=1
        )
        result["diffusion"] = _measure(
            omni,
            [a[f"z_{k}"] for k in ("attn", "qv", "ff", "embed")],
            lambda lora: omni.generate("a cat", dp, lora_request=lora, use_tqdm=False),
            lambda: omni.generate("a cat", dp, use_tqdm=False),
        )
    opts = dict(enable_lora=True, max_lora_rank=16, max_loras=2, max_model_len=128, dtype="float32")
    with Omni(a["llm"], **opts) as omni:
        sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        result["llm"] = _measure(
            omni,
            [a["llm_a"], a["llm_b"], a["llm_a"], a["llm_b"]],
            lambda lora: omni.generate("hello world", sp, lora_request=lora, use_tqdm=False),
            lambda: omni.generate("hello world", sp, use_tqdm=False),
        )
    Path(out).write_text(json.dumps(result))


def _run_child(tree: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out)]
    subprocess.run(cmd, env=env, cwd=str(tree), check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def fingerprint_vs_parse(mib: int = 64) -> dict[str, float]:
    """Seconds to fingerprint a ``mib`` MiB safetensors adapter file vs to parse it with safetensors."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_omni.lora.adapter_files import AdapterFiles, fingerprint_files

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adapter_model.safetensors")
        n = mib * 2**20 // 4 // 64
        save_file({f"m{i}.lora_A.weight": torch.randn(n // 16, 16) for i in range(64)}, path)
        files = AdapterFiles(path, None, False)
        hashes = [_timed(lambda: fingerprint_files(files)) for _ in range(5)]
        parses = [_timed(lambda: load_file(path)) for _ in range(5)]
    return {"mib": mib, "fingerprint_s": statistics.median(hashes), "parse_s": statistics.median(parses)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", help="a checkout without the registry (its vllm_omni is imported)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--json", default="benchmarks/results/adapter_registry.json")
    args = p.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    load_before = os.getloadavg()
    sides: dict[str, list[dict]] = {"baseline": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = [("baseline", Path(args.baseline)), ("this", REPO)]
            for name, tree in order if r % 2 == 0 else order[::-1]:
                sides[name].append(_run_child(tree, Path(tmp) / f"{name}{r}.json"))
                print(f"round {r} {name}: {json.dumps(sides[name][-1])}", flush=True)
    ratios = {}
    for kind in ("diffusion", "llm"):
        for metric in ("add_s", "remove_s", "switch_request_s", "base_request_s"):
            per_round = [t[kind][metric] / b[kind][metric] for t, b in zip(sides["this"], sides["baseline"])]
            ratios[f"{kind}.{metric}"] = statistics.median(per_round)
    fp = fingerprint_vs_parse()
    result = {"rounds": sides, "ratio_this_over_baseline": ratios, "fingerprint": fp}
    result["loadavg_before"], result["loadavg_after"] = load_before, os.getloadavg()
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{'metric':32} {'baseline ms':>12} {'this ms':>10} {'this/baseline':>14}")
    for key, ratio in ratios.items():
        kind, metric = key.split(".")
        base = statistics.median(s[kind][metric] for s in sides["baseline"]) * 1e3
        this = statistics.median(s[kind][metric] for s in sides["this"]) * 1e3
        print(f"{key:32} {base:12.2f} {this:10.2f} {ratio:14.3f}")
    print(f"fingerprint of {fp['mib']} MiB: {fp['fingerprint_s'] * 1e3:.1f} ms; safetensors parse: "
          f"{fp['parse_s'] * 1e3:.1f} ms (x{fp['fingerprint_s'] / fp['parse_s']:.2f})")  # fmt: skip
    print(f"load average before {load_before}, after {result['loadavg_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
