"""Stage pipelining of ``llm_to_diffusion``: ``worker_backend`` ``mp`` against ``inline``.

The tiny test models (a Qwen2 LLM stage whose text prompts a tiny Z-Image diffusion stage), 8
requests submitted together. For each backend, measured in the same run (wall clock):

* ``T0``: the 8 requests through stage 0 alone, ``T1``: their stage-0 texts through stage 1 alone
  (each stage batches as it does inside the pipeline). ``8 / max(T0, T1)`` is the throughput of a
  perfect pipeline, bounded by its slowest stage.
* ``T``: the 8 requests through the whole pipeline. ``ratio = max(T0, T1) / T`` is the throughput
  reached against that bound (1.0: the stages overlap perfectly; a pipeline that runs the stages
  one after the other gets about ``max / (T0 + T1)``).
* ``latency``: one request through the pipeline alone (the per-request cost of the backend).

``torch_threads`` records each stage's torch intra-op pool (an ``mp`` worker's as its worker reports it;
with ``mp`` on CPU, the cores are split between the workers: ``vllm_omni.engine.cpu_threads``), and the
results keep the load average before and after and the thread variables of the run.

Each measurement is the median of ``--repeats`` runs after a warm-up. One pipeline runs at a
time: the inline one first, then the mp one (a change of the machine's load between them shows
in ``mp_vs_inline``, not in each backend's own ``ratio``).

Run from the repository root::

    .venv/bin/python -m benchmarks.pipelining            # writes benchmarks/results/pipelining.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

N_REQUESTS = 8
RESULTS = Path(__file__).resolve().parent / "results" / "pipelining.json"


def _assets() -> tuple[str, str]:
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets
    from tools.make_tiny_llm import ensure_tiny_llm_assets

    root = test_assets_root()
    return str(ensure_tiny_llm_assets(root).model_dir), str(ensure_tiny_diffusion_assets(root)["z_image"])


def _deploy(folder: str, llm: str, z_image: str, args) -> str:
    path = os.path.join(folder, "pipelining.yaml")
    with open(path, "w") as f:
        f.write(
            "pipeline: llm_to_diffusion\n"
            "stages:\n"
            f"  - stage_id: 0\n    model: {llm}\n    engine_extras: {{max_model_len: 256, dtype: float32}}\n"
            f"  - stage_id: 1\n    model: {z_image}\n    dtype: float32\n    enable_progress_bar: false\n"
            f"    max_batch_size: {args.diffusion_batch}\n"
        )
    return path


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(backend: str, deploy: str, args) -> dict[str, list[float]]:
    """``{"T0": [...], "T1": [...], "T": [...], "latency": [...]}`` seconds for one backend."""
    import torch
    from vllm import SamplingParams

    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.inputs.stage_request import StageRequest

    llm = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    diff = OmniDiffusionSamplingParams(
        height=args.size, width=args.size, num_inference_steps=args.steps, seed=0
    )
    prompts = [f"prompt number {i}" for i in range(N_REQUESTS)]
    out: dict[str, list[float]] = {"T0": [], "T1": [], "T": [], "latency": []}
    with Omni(deploy_config=deploy, worker_backend=backend) as omni:
        s0, s1 = omni._orchestrator.runtimes
        # torch intra-op threads of each stage's worker (mp; inline stages share this process's)
        out["torch_threads"] = [getattr(s, "torch_threads", 0) or torch.get_num_threads() for s in (s0, s1)]
        texts = [o.prompt for o in omni.generate(prompts, [llm, diff], use_tqdm=False)]  # warm-up

        def stage(runtime, inputs, params) -> None:
            with runtime.hold():
                futures = [runtime.submit(StageRequest(p, params)) for p in inputs]
            for f in futures:
                f.result()

        for _ in range(args.repeats):
            out["T0"].append(_timed(lambda: stage(s0, prompts, omni._orchestrator.prepare_params([llm])[0])))
            out["T1"].append(_timed(lambda: stage(s1, texts, diff)))
            out["T"].append(_timed(lambda: omni.generate(prompts, [llm, diff], use_tqdm=False)))
            out["latency"].append(_timed(lambda: omni.generate(prompts[:1], [llm, diff], use_tqdm=False)))
    return out


def summarize(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    table = {}
    for backend, s in samples.items():
        med = {k: statistics.median(s[k]) for k in ("T0", "T1", "T", "latency")}
        bound = max(med["T0"], med["T1"])
        table[backend] = {
            **{f"{k}_s": round(v, 4) for k, v in med.items()},
            "throughput_req_s": round(N_REQUESTS / med["T"], 3),
            "bound_req_s": round(N_REQUESTS / bound, 3),
            "ratio": round(bound / med["T"], 3),
            "serial_ratio": round(bound / (med["T0"] + med["T1"]), 3),
            "torch_threads": s.get("torch_threads"),
        }
    if {"mp", "inline"} <= set(table):
        table["mp_vs_inline"] = {
            "throughput": round(table["mp"]["throughput_req_s"] / table["inline"]["throughput_req_s"], 3),
            "latency": round(table["mp"]["latency_s"] / table["inline"]["latency_s"], 3),
        }
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="tokens stage 0 writes per request")
    parser.add_argument("--size", type=int, default=64, help="image side of stage 1")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps of stage 1")
    parser.add_argument("--diffusion-batch", type=int, default=1, help="stage 1 max_batch_size")
    parser.add_argument("--backends", nargs="+", default=["inline", "mp"])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm, z_image = _assets()
    load_before = os.getloadavg()
    samples = {}
    with tempfile.TemporaryDirectory() as folder:
        deploy = _deploy(folder, llm, z_image, args)
        for backend in args.backends:
            samples[backend] = measure(backend, deploy, args)
    table = summarize(samples)
    print(json.dumps(table, indent=2))
    result = {
        "args": vars(args),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load": os.getloadavg(),
        },
        "env": {
            k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "VLLM_CPU_OMP_THREADS_BIND")
        },
        "samples": samples,
        "summary": table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
