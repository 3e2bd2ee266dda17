"""Compiled diffusion denoiser (regional ``torch.compile``, LoRA from fixed-shape banks) vs eager.

One run on the in-tree Z-Image transformer (random weights in diffusers format under
``.cache/bench_assets``, PEFT adapters of rank ``r`` on ``to_q to_k to_v to_out.0 w1 w2 w3``):

1. first compile time of the base graph (fresh cache directory) and the warm-restart time (a new
   process with the same cache directory after another process filled it and exited: dynamo traces
   again, inductor's FX graph cache hits);
2. compiled base / eager base step time (one denoiser forward, interleaved pairs, process CPU time,
   each timed step after one untimed step of the same condition: a request's steady state);
3. for K = 1, 4 adapters and r = 16, 64 (manager sized ``max_loras=K``, ``max_rank=r``): compiled
   LoRA / compiled base next to eager LoRA / eager base and the FLOP floor of the patched layers,
   and the LoRA step's own cost in ms on each side;
4. dynamo graphs created over ``--switches`` random switches (adapter sets, scales incl. 0, per-step
   and per-block schedules, mixed batches, batch sizes 2..4 and two image sizes): must be 0;
5. bytes of the banks vs the host cache's prepared slot weights of the same adapters.

Run from the repository root::

    .venv/bin/python -m benchmarks.diffusion_compile            # dim 1024, 4 + 1 + 1 blocks, 256 image tokens
    .venv/bin/python -m benchmarks.diffusion_compile --quick    # dim 256 smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.diffusion_assets import ensure_adapter, ensure_transformer, flop_floor, model_config
from benchmarks.timing import Timer, paired

REPO = Path(__file__).resolve().parent.parent


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="dim 256, 2 blocks, 1 repeat, 40 switches")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--refiner-layers", type=int, default=1)
    p.add_argument("--latent", type=int, default=32, help="latent H = W (image tokens = (latent/2)^2)")
    p.add_argument("--cap-tokens", type=int, default=32)
    p.add_argument("--ranks", type=int, nargs="*", default=[16, 64])
    p.add_argument("--ks", type=int, nargs="*", default=[1, 4])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--switches", type=int, default=200)
    p.add_argument(
        "--only-switches", action="store_true", help="only the random-switch recompile count (no timings)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype (bfloat16 runs on AMX where the CPU has it)",
    )
    p.add_argument("--assets", default=str(REPO / ".cache" / "bench_assets"))
    p.add_argument("--json", default="benchmarks/results/diffusion_compile.json")
    p.add_argument("--restart-probe", default=None, help=argparse.SUPPRESS)  # internal: cache dir
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.latent, args.repeats, args.switches = 256, 2, 16, 1, 40
    return args


class Bench:
    """The model folder, two model copies (eager, compiled) and helpers around them."""

    def __init__(self, args, cache_dir: str):
        import torch

        from vllm_omni.diffusion.compile import RegionalCompiler
        from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
        from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel
        from vllm_omni.platform import keep_freed_cpu_memory

        torch.set_num_threads(args.threads)
        keep_freed_cpu_memory()  # as the CPU diffusion worker does before it builds a model
        self.dtype = getattr(torch, args.dtype)
        if self.dtype == torch.bfloat16:
            from vllm_omni.platform import request_amx_permission

            request_amx_permission()  # as the diffusion worker does before running bf16 kernels
        init_diffusion_parallel_state(world_size=1, rank=0)
        self.args = args
        self.cfg = model_config(args.dim, args.layers, args.refiner_layers, cap_dim=512)
        self.folder = ensure_transformer(Path(args.assets), self.cfg)
        self.eager = ZImageTransformer2DModel.from_pretrained(self.folder, dtype=self.dtype)
        self.compiled = ZImageTransformer2DModel.from_pretrained(self.folder, dtype=self.dtype)
        self.managers: dict = {}
        self.compiler = RegionalCompiler(
            self.compiled,
            cache_dir=cache_dir,
            before_call=lambda: self.managers.get("compiled") and self.managers["compiled"].sync_step(),
        )
        self.gen = torch.Generator().manual_seed(0)

    def inputs(self, batch: int, latent: int | None = None):
        import torch

        latent = latent or self.args.latent
        xs = [torch.randn(16, 1, latent, latent, generator=self.gen).to(self.dtype) for _ in range(batch)]
        caps = [
            torch.randn(self.args.cap_tokens + 7 * i, 512, generator=self.gen).to(self.dtype)
            for i in range(batch)
        ]
        return xs, torch.linspace(0.2, 0.8, batch), caps

    def step(self, model, inputs):
        import torch

        with torch.inference_mode():
            return model(*inputs)

    def wrap(self, k: int, r: int) -> None:
        """(Re)build both managers with ``max_loras=k``, ``max_rank=r`` (unwrapping the previous ones)."""
        from vllm_omni.diffusion.lora import DiffusionLoRAManager

        for manager in self.managers.values():
            for name, target in manager._index.targets.items():
                setattr(target.parent, target.attr, manager.wrappers[name].base_layer)
        self.managers = {
            "eager": DiffusionLoRAManager(self.eager, max_loras=k, max_rank=r, max_cpu_loras=k + 8),
            "compiled": DiffusionLoRAManager(
                self.compiled, max_loras=k, max_rank=r, max_cpu_loras=k + 8, banks=True
            ),
        }

    def adapters(self, r: int, n: int):
        from vllm_omni.lora.request import LoRARequest

        adir = self.folder.parent / "adapters"
        paths = [ensure_adapter(adir / f"r{r}_{i}", self.cfg, r, seed=1000 * r + i) for i in range(n)]
        return [LoRARequest(p.name, 100 * r + i + 1, str(p)) for i, p in enumerate(paths)]


def restart_probe(args) -> None:
    """A fresh process: build, compile the base graph from the cache in ``args.restart_probe``, print seconds."""
    bench = Bench(args, args.restart_probe)
    x = bench.inputs(1)
    t0 = time.perf_counter()
    bench.step(bench.compiled, x)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    bench.step(bench.compiled, x)
    import torch

    inductor = torch._dynamo.utils.counters["inductor"]
    hits = {k: inductor[k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}
    print(json.dumps({"first_call_s": first, "second_call_s": time.perf_counter() - t0, **hits}))


def _compile_times(bench, cache_dir: str, args) -> dict:
    x = bench.inputs(1)
    bench.step(bench.eager, x)
    t0 = time.perf_counter()
    bench.step(bench.eager, x)
    eager_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    bench.step(bench.compiled, x)
    first = time.perf_counter() - t0
    cmd = [sys.executable, "-m", "benchmarks.diffusion_compile", "--restart-probe", cache_dir]
    cmd += ["--dim", str(args.dim), "--layers", str(args.layers), "--latent", str(args.latent)]
    cmd += ["--refiner-layers", str(args.refiner_layers), "--cap-tokens", str(args.cap_tokens)]
    cmd += ["--dtype", args.dtype, "--threads", str(args.threads)]
    # a restarted worker starts after the previous process exited: inductor's FX graph cache entries
    # written by this (still running) process were measured not to hit (fxgraph_cache_miss 2) while
    # those of an exited process do, so the cache is filled by one probe process and timed in a second
    probes = []
    for _ in range(2):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
        probes.append(json.loads(out.stdout.strip().splitlines()[-1]))
    probe = probes[-1]
    return {
        "eager_step_s": eager_s,
        "first_compile_s": first - eager_s,
        "fresh_process_compile_s": probes[0]["first_call_s"] - probes[0]["second_call_s"],
        "fresh_process_cache": {k: v for k, v in probes[0].items() if k.startswith("fxgraph")},
        "warm_restart_compile_s": probe["first_call_s"] - probe["second_call_s"],
        "warm_restart_cache": {k: v for k, v in probe.items() if k.startswith("fxgraph")},
        "graphs": bench.compiler.stats.graphs,
    }


def _ratios(bench, timer, args, k: int, r: int) -> dict:
    bench.wrap(k, r)
    reqs = bench.adapters(r, k)
    x = bench.inputs(1)
    sides = {}
    for side, model in (("eager", bench.eager), ("compiled", bench.compiled)):
        manager = bench.managers[side]
        sides[side] = (
            lambda m=model: bench.step(m, x),
            manager.deactivate,
            lambda m=manager: m.set_active_adapters(reqs, [1.0] * k),
        )
    t0 = time.perf_counter()
    # one untimed step after each switch: the timed step is one of a request that keeps its adapters
    res = paired(timer, sides, args.repeats, warm_base=True, settle=1)
    image_tokens = (args.latent // 2) ** 2
    floor, share = flop_floor(bench.cfg, k * r, image_tokens, args.cap_tokens + (-args.cap_tokens) % 32)
    for manager in bench.managers.values():
        manager.deactivate()
    banks = bench.managers["compiled"].banks
    return {
        "eager_ratio": res["eager"]["ratio"],
        "compiled_ratio": res["compiled"]["ratio"],
        "compiled_base_s": res["compiled"]["base_s"],
        "eager_base_s": res["eager"]["base_s"],
        # the LoRA step's extra cost itself, per step (ms): compiled vs eager on the same adapters
        "compiled_lora_ms": 1e3 * (res["compiled"]["lora_s"] - res["compiled"]["base_s"]),
        "eager_lora_ms": 1e3 * (res["eager"]["lora_s"] - res["eager"]["base_s"]),
        "flop_floor": 1 + floor * share,
        "bank_bytes": banks.nbytes(),
        "slot_bytes": sum(bench.managers["compiled"].cached_nbytes(q.lora_int_id) for q in reqs),
        "wall_s": time.perf_counter() - t0,
    }


def _switches(bench, args) -> dict:
    """Random switches on the compiled model (K=4 banks at the smallest rank); graphs created."""
    import torch

    from vllm_omni.diffusion.forward_context import denoising_step, set_forward_context
    from vllm_omni.lora.schedule import LoRAScaleSchedule

    k, r = max(args.ks), min(args.ranks)
    bench.wrap(k, r)
    pool = bench.adapters(r, k + 2)
    manager = bench.managers["compiled"]
    rng = random.Random(0)
    sizes = (8, 12)

    def scale():
        kind = rng.random()
        if kind < 0.15:
            return 0.0
        if kind < 0.3:
            return LoRAScaleSchedule([rng.uniform(-1, 2), rng.uniform(-1, 2)])
        if kind < 0.45:
            return LoRAScaleSchedule(rng.uniform(0.2, 1.5), {f"layers.{rng.randrange(args.layers)}": 0.3})
        return rng.uniform(-2, 2)

    for batch in (2, 3):  # warm-up: both graphs (base, LoRA) with more than one row
        bench.step(bench.compiled, bench.inputs(batch, sizes[0]))
        manager.set_active_adapters([pool[0]], [1.0])
        bench.step(bench.compiled, bench.inputs(batch, sizes[0]))
        manager.deactivate()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    for i in range(args.switches):
        batch = rng.randint(2, 4)
        per_sample = [rng.sample(pool, rng.randint(0, min(3, k))) for _ in range(batch)]
        while len({q.lora_int_id for s in per_sample for q in s}) > k:
            per_sample[rng.randrange(batch)] = []
        manager.set_active_adapters(per_sample, [[scale() for _ in s] for s in per_sample])
        with set_forward_context(), denoising_step(i % 2, 2):
            bench.step(bench.compiled, bench.inputs(batch, rng.choice(sizes)))
        manager.deactivate()
    return {
        "switches": args.switches,
        "new_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - before,
        "seconds": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.restart_probe:
        restart_probe(args)
        return 0
    cache_dir = tempfile.mkdtemp(prefix="vllm_omni_compile_bench_")
    bench = Bench(args, cache_dir)
    timer = Timer("cpu", "cpu")
    result = {"args": vars(args), "uptime": os.popen("uptime").read().strip()}
    if args.only_switches:
        result["switches"] = _switches(bench, args)
        print("switches:", json.dumps(result["switches"]), flush=True)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        return 0
    result["compile"] = _compile_times(bench, cache_dir, args)
    print("compile:", json.dumps(result["compile"]), flush=True)
    result["lora"] = {}
    for k in args.ks:
        for r in args.ranks:
            result["lora"][f"K={k} r={r}"] = row = _ratios(bench, timer, args, k, r)
            print(f"K={k} r={r}:", json.dumps({k2: round(v, 4) for k2, v in row.items()}), flush=True)
    first = next(iter(result["lora"].values()))
    result["compiled_over_eager_base"] = first["eager_base_s"] / first["compiled_base_s"]
    print(f"compiled base / eager base speed-up: {result['compiled_over_eager_base']:.3f}x", flush=True)
    result["switches"] = _switches(bench, args)
    print("switches:", json.dumps(result["switches"]), flush=True)
    result["uptime_end"] = os.popen("uptime").read().strip()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
