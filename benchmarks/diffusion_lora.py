"""Diffusion LoRA cost and adapter switching, ours vs diffusers + peft, measured in one run.

Both sides load the same random Z-Image transformer (written once in diffusers format under
``.cache/bench_assets``) and the same PEFT adapters (rank ``r``, ``lora_alpha = r``, targets
``to_q to_k to_v to_out.0 w1 w2 w3`` in every block):

* ours: the in-tree ``ZImageTransformer2DModel`` on vLLM layers + ``DiffusionLoRAManager``;
* reference: diffusers ``ZImageTransformer2DModel`` + peft through ``load_lora_adapter`` /
  ``set_adapters`` (unfused).

Measured (one denoiser forward = one denoising step, medians of ``--repeats`` after a warm-up;
ratios are taken pairwise from interleaved runs so they hold on a loaded machine):

1. step-time ratio with LoRA / without for K = 1, 2, 4 composed adapters of rank 16 and 64,
   ours vs diffusers+peft, next to the FLOP floor ``r (d_in + d_out) / (d_in d_out)`` of the
   patched layers (FLOP-weighted over them);
2. adapter switch (make a different, already host-cached adapter set active) as a fraction of a
   step, ours vs diffusers ``set_adapters``; ours both when the new adapter is already in a
   device slot and when it has to be written into one;
3. our switch time with 64 adapters registered vs 2 (resp. 6 for the slot-write case);
4. a batch of 4 requests with 4 different adapters vs the 4 run one by one (ours only);
5. bytes held by the host cache for 64 adapters vs the sum of their file sizes (and RSS delta).

Run from the repository root::

    .venv/bin/python -m benchmarks.diffusion_lora            # hidden 1024, 8+2+2 blocks, 1024 image tokens, fp32 CPU
    .venv/bin/python -m benchmarks.diffusion_lora --quick    # small model, smoke run
    .venv/bin/python -m benchmarks.diffusion_lora --device cuda --dim 1536 --layers 16   # GPU (bf16)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from pathlib import Path

from benchmarks.diffusion_assets import (
    adapter_metadata,
    ensure_adapter,
    ensure_transformer,
    flop_floor,
    lora_shapes,
    model_config,
)
from benchmarks.timing import PeakRSS, Timer, lora_op_share, median, paired, trim_heap

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="small model (dim 512, 4 layers, 256 tokens), 2 repeats"
    )
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--refiner-layers", type=int, default=2)
    p.add_argument("--latent", type=int, default=64, help="latent H = W (image tokens = (latent/2)^2)")
    p.add_argument("--cap-tokens", type=int, default=64)
    p.add_argument("--ranks", type=int, nargs="*", default=[16, 64])
    p.add_argument("--ks", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--goal-repeats", type=int, default=15, help="repeats for the goal case K=1, lowest rank")
    p.add_argument("--switch-repeats", type=int, default=20)
    p.add_argument("--registered", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU default 1)")
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default=None,
        help="cpu: process CPU time (CPU default); wall: CUDA default",
    )
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="only profile (torch.profiler) our K=1 step and a 4-adapter mixed batch step; print the top ops",
    )
    p.add_argument("--skip", nargs="*", default=[], help="sections to skip: step switch batch memory")
    p.add_argument("--assets", default=str(REPO / ".cache" / "bench_assets"))
    p.add_argument("--json", default="benchmarks/results/diffusion_lora.json")
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.refiner_layers, args.latent, args.cap_tokens = 512, 4, 1, 32, 32
        args.repeats = min(args.repeats, 2)
        args.goal_repeats = min(args.goal_repeats, 3)
        args.registered = min(args.registered, 16)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import torch

    torch.set_flush_denormal(True)
    device = args.device
    on_cuda = device.startswith("cuda")
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_cuda else "float32"))
    args.clock = args.clock or ("wall" if on_cuda else "cpu")
    if args.threads or not on_cuda:
        torch.set_num_threads(args.threads or 1)
    timer = Timer(device, args.clock)
    root = Path(args.assets)
    root.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args.dim, args.layers, args.refiner_layers, cap_dim=512)
    t0 = time.perf_counter()
    folder = ensure_transformer(root, cfg)
    adir = folder.parent / "adapters"
    ranks = sorted(set(args.ranks))
    kmax = max(args.ks)
    sets = {
        r: [ensure_adapter(adir / f"r{r}_{i}", cfg, r, seed=1000 * r + i) for i in range(kmax)] for r in ranks
    }
    r0 = ranks[0]
    n_extra = max(args.registered, 6)
    extra = [ensure_adapter(adir / f"r{r0}_{i}", cfg, r0, seed=1000 * r0 + i) for i in range(n_extra)]
    print(f"assets ready in {time.perf_counter() - t0:.1f}s under {folder.parent}", flush=True)

    from diffusers import ZImageTransformer2DModel as Reference

    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
    from vllm_omni.diffusion.lora import DiffusionLoRAManager
    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel
    from vllm_omni.lora.request import LoRARequest

    init_diffusion_parallel_state(world_size=1, rank=0)
    ours = ZImageTransformer2DModel.from_pretrained(folder, dtype=dtype, device=device)
    ref = Reference.from_pretrained(str(folder), torch_dtype=dtype).to(device).eval().requires_grad_(False)

    gen = torch.Generator().manual_seed(0)

    def inputs(batch: int):
        xs = [
            torch.randn(16, 1, args.latent, args.latent, generator=gen).to(device, dtype)
            for _ in range(batch)
        ]
        caps = [
            torch.randn(args.cap_tokens, cfg["cap_feat_dim"], generator=gen).to(device, dtype)
            for _ in range(batch)
        ]
        return xs, torch.linspace(0.2, 0.8, batch).to(device), caps

    x1, t1, c1 = inputs(1)
    x4, t4, c4 = inputs(4)
    image_tokens = (args.latent // 2) ** 2
    cap_tokens = args.cap_tokens + (-args.cap_tokens) % 32

    @torch.inference_mode()
    def ours_step():
        return ours(x1, t1, c1)

    @torch.inference_mode()
    def ref_step():
        return ref(x1, t1, c1, return_dict=False)[0]

    # sanity: the two models agree without LoRA
    with torch.inference_mode():
        err = max((a - b).abs().max().item() for a, b in zip(ours_step(), ref_step(), strict=True))
    print(f"base outputs ours vs diffusers: max abs diff {err:.2e}", flush=True)

    manager = DiffusionLoRAManager(
        ours, max_loras=kmax, max_rank=max(ranks), max_cpu_loras=n_extra + kmax * len(ranks) + 2
    )
    next_id = iter(range(1, 10_000))
    ours_req: dict[Path, LoRARequest] = {}

    def req(path: Path) -> LoRARequest:
        if path not in ours_req:
            ours_req[path] = LoRARequest(path.name, next(next_id), str(path))
            manager.add_lora(ours_req[path])
        return ours_req[path]

    ref_names: dict[Path, str] = {}

    def ref_name(path: Path) -> str:
        if path not in ref_names:
            from safetensors.torch import load_file

            state = {
                k.removeprefix("base_model.model."): v
                for k, v in load_file(str(path / "adapter_model.safetensors")).items()
            }
            ref_names[path] = f"a{len(ref_names)}"
            ref.load_lora_adapter(
                state, prefix=None, adapter_name=ref_names[path], metadata=adapter_metadata(path)
            )
        return ref_names[path]

    result: dict = {"step": {}, "switch": {}, "batch": {}, "memory": {}}

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        four = [req(pth) for pth in extra[:4]]
        tables = {}
        for label, reqs, scales, xs in (
            (f"K=1 r={r0}, batch 1", [four[0]], [1.0], (x1, t1, c1)),
            ("4 adapters, mixed batch of 4", [[rq] for rq in four], [[1.0]] * 4, (x4, t4, c4)),
            ("no LoRA, batch 1", None, None, (x1, t1, c1)),
        ):
            if reqs is None:
                manager.deactivate()
            else:
                manager.set_active_adapters(reqs, scales)
            with torch.inference_mode():
                ours(*xs)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    ours(*xs)
            tables[label] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
            print(f"\n=== profile: {label}\n{tables[label]}", flush=True)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"profile": tables}, indent=2))
        print(f"wrote {args.json}")
        return 0

    # 1. step-time ratios -------------------------------------------------------------------
    if "step" not in args.skip:
        for r in ranks:
            floor, share = flop_floor(cfg, r, image_tokens, cap_tokens)
            for k in args.ks:
                paths = sets[r][:k]
                reqs = [req(pth) for pth in paths]
                names = [ref_name(pth) for pth in paths]

                def ref_on(names=names):
                    ref.enable_adapters()
                    ref.set_adapters(names, [1.0] * len(names))

                def ours_on(reqs=reqs):
                    manager.set_active_adapters(reqs, [1.0] * len(reqs))

                goal_case = k == 1 and r == r0
                both = paired(
                    timer,
                    {
                        "ours": (ours_step, manager.deactivate, ours_on),
                        "diffusers_peft": (ref_step, ref.disable_adapters, ref_on),
                    },
                    max(args.repeats, args.goal_repeats) if goal_case else args.repeats,
                    warm_base=not result["step"],
                )
                o, d = both["ours"], both["diffusers_peft"]
                kernels = None
                if not on_cuda:  # the LoRA ops' own CPU time inside a step (see timing.lora_op_share)
                    ours_on()
                    kernels = lora_op_share(ours_step, {type(w) for w in manager.wrappers.values()})
                    kernels["over_floor"] = kernels["lora_over_base"] / (k * floor)
                    manager.deactivate()
                row = {
                    "r": r,
                    "K": k,
                    "floor": k * floor,
                    "step_floor": k * floor * share,
                    "ours": o,
                    "diffusers_peft": d,
                    "patched_share_of_step_flops": share,
                    "ours_overhead_over_floor": (o["ratio"] - 1) / (k * floor),
                    "ours_overhead_over_floor_min": (o["ratio_min"] - 1) / (k * floor),
                    "ours_lora_kernels": kernels,
                }
                result["step"][f"K{k}_r{r}"] = row
                print(
                    f"  K={k} r={r}: ours {o['ratio']:.3f} (min {o['ratio_min']:.3f}, {o['base_s']:.2f}s base), "
                    f"diffusers+peft {d['ratio']:.3f} (min {d['ratio_min']:.3f}, {d['base_s']:.2f}s base), "
                    f"floor +{k * floor:.3%}",
                    flush=True,
                )
        manager.deactivate()
        ref.disable_adapters()

    # 2./3. adapter switch -------------------------------------------------------------------
    if "switch" not in args.skip:
        manager.deactivate()
        if getattr(ref, "peft_config", None):  # adapters were loaded by the step section
            ref.disable_adapters()
        step_s = median([timer(ours_step) for _ in range(2)])
        ref_step_s = median([timer(ref_step) for _ in range(2)])
        manager.deactivate()
        for rid in manager.list_loras():  # start from an empty registry: 2, then 6, then 64 adapters
            manager.remove_lora(rid)
        ours_req.clear()
        pool = extra[: kmax + 2]  # more adapters than slots: cycling through them forces slot writes
        pool_reqs = [req(pth) for pth in pool[:2]]

        def switch_times(cycle: list[LoRARequest]) -> float:
            samples = []
            for i in range(args.switch_repeats + len(cycle)):
                rq = cycle[i % len(cycle)]
                dt = timer(lambda rq=rq: manager.set_active_adapters([rq], [1.0]))
                if i >= len(cycle):  # first lap is warm-up
                    samples.append(dt)
            manager.deactivate()
            return median(samples)

        resident_2 = switch_times(pool_reqs[:2])
        pool_reqs += [req(pth) for pth in pool[2:]]
        writes_before = manager.slot_writes
        slot_write_few = switch_times(pool_reqs)
        assert manager.slot_writes > writes_before, "cycling more adapters than slots must write slots"

        ref_pool = [ref_name(pth) for pth in pool[:2]]
        ref.enable_adapters()
        ref_samples = []
        for i in range(args.switch_repeats + 2):
            dt = timer(lambda i=i: ref.set_adapters([ref_pool[i % 2]], [1.0]))
            if i >= 2:
                ref_samples.append(dt)
        ref_switch = median(ref_samples)
        ref.disable_adapters()

        # register many more adapters, then repeat the same switches
        t_reg = time.perf_counter()
        many = [req(pth) for pth in extra[: args.registered]]
        t_reg = time.perf_counter() - t_reg
        n_registered = len(manager.list_loras())
        resident_many = switch_times(pool_reqs[:2])
        slot_write_many = switch_times(pool_reqs)
        result["switch"] = {
            "step_s_ours": step_s,
            "step_s_diffusers": ref_step_s,
            "ours_resident_s": resident_2,
            "ours_slot_write_s": slot_write_few,
            "diffusers_set_adapters_s": ref_switch,
            "ours_resident_frac_of_step": resident_2 / step_s,
            "ours_slot_write_frac_of_step": slot_write_few / step_s,
            "diffusers_frac_of_step": ref_switch / ref_step_s,
            "speedup_resident": ref_switch / resident_2,
            "speedup_slot_write": ref_switch / slot_write_few,
            "registered_few": {"resident": 2, "slot_write": len(pool_reqs)},
            "registered_many": n_registered,
            "ours_resident_many_s": resident_many,
            "ours_slot_write_many_s": slot_write_many,
            "flat_ratio_resident": resident_many / resident_2,
            "flat_ratio_slot_write": slot_write_many / slot_write_few,
            "register_many_s": t_reg,
        }
        del many

    # 4. mixed batch of 4 adapters vs 4 sequential runs ----------------------------------------
    if "batch" not in args.skip:
        four = [req(pth) for pth in extra[:4]]

        @torch.inference_mode()
        def batched():
            manager.set_active_adapters([[rq] for rq in four], [[1.0]] * 4)
            ours(x4, t4, c4)

        @torch.inference_mode()
        def one_by_one():
            for i, rq in enumerate(four):
                manager.set_active_adapters([rq], [1.0])
                ours([x4[i]], t4[i : i + 1], [c4[i]])

        @torch.inference_mode()
        def base_batched():
            manager.deactivate()
            ours(x4, t4, c4)

        @torch.inference_mode()
        def base_one_by_one():
            manager.deactivate()
            for i in range(4):
                ours([x4[i]], t4[i : i + 1], [c4[i]])

        batched()
        tb, ts, rs = [], [], []
        for _ in range(max(2, args.repeats - 1)):
            b, s = timer(batched), timer(one_by_one)
            tb.append(b)
            ts.append(s)
            rs.append(b / s)
        bb, bs = [timer(base_batched)], [timer(base_one_by_one)]  # context: batching without LoRA
        manager.deactivate()
        result["batch"] = {
            "batch4_s": median(tb),
            "one_by_one_s": median(ts),
            "ratio": median(rs),
            "base_batch4_s": median(bb),
            "base_one_by_one_s": median(bs),
            "base_ratio": median(bb) / median(bs),
        }

    # 5. host cache memory ----------------------------------------------------------------------
    if "memory" not in args.skip:
        gc.collect()
        before_ids = set(manager.list_loras())
        for rid in before_ids:
            manager.remove_lora(rid)
        gc.collect()
        trim_heap()  # hand freed heap pages back, or the new loads reuse them and RSS shows nothing
        paths = extra[: args.registered]
        file_bytes = sum((pth / "adapter_model.safetensors").stat().st_size for pth in paths)
        with PeakRSS() as rss:
            for pth in paths:
                ours_req.pop(pth, None)
                req(pth)
        seen: set[int] = set()
        held = 0
        for rid in manager.list_loras():
            for weights in manager.cache_entry(rid).payload.values():
                for tensor in weights.tensors():
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        held += storage.nbytes()
        lora_bytes = sum(4 * r0 * (d_in + d_out) for d_in, d_out in lora_shapes(cfg).values()) * len(paths)
        result["memory"] = {
            "adapters": len(paths),
            "file_bytes": file_bytes,
            "lora_tensor_bytes": lora_bytes,
            "cache_tensor_bytes": held,
            "cache_over_files": held / file_bytes,
            "rss_delta_bytes": rss.end - rss.start,
            "rss_peak_delta_bytes": rss.peak - rss.start,
            "rss_peak_over_files": (rss.peak - rss.start) / file_bytes,
        }

    # report -------------------------------------------------------------------------------------
    hidden = int(cfg["dim"] / 3 * 8)
    print(
        f"\nDiffusion LoRA: Z-Image dim {cfg['dim']} (ffn {hidden}), {cfg['n_layers']} layers + "
        f"{cfg['n_refiner_layers']}+{cfg['n_refiner_layers']} refiner blocks, {image_tokens} image + {cap_tokens} "
        f"caption tokens, {dtype} on {device}, {torch.get_num_threads()} thread(s), {args.clock} clock, median of {args.repeats}"
    )
    if result["step"]:
        print(
            f"\n{'K':>2} {'r':>3} {'floor':>8} {'ours':>8} {'ours min':>9} {'diffusers':>10} {'diff min':>9} "
            f"{'ours/floor':>11} {'ours s':>8} {'diff s':>8}"
        )
        for row in result["step"].values():
            o, d = row["ours"], row["diffusers_peft"]
            print(
                f"{row['K']:>2} {row['r']:>3} {row['floor']:>+8.2%} {o['ratio'] - 1:>+8.2%} {o['ratio_min'] - 1:>+9.2%} "
                f"{d['ratio'] - 1:>+10.2%} {d['ratio_min'] - 1:>+9.2%} "
                f"{row['ours_overhead_over_floor']:>11.2f} {o['lora_s']:>8.3f} {d['lora_s']:>8.3f}"
            )
        print(
            "(overheads = step with LoRA / without - 1; floor = K r (d_in+d_out)/(d_in d_out) over patched layers)"
        )
        if any(row["ours_lora_kernels"] for row in result["step"].values()):
            print(
                f"\nOur LoRA ops in place (torch.profiler, one step): {'K':>2} {'r':>3} {'floor':>8} "
                f"{'LoRA / base of patched layers':>30} {'/ floor':>8} {'LoRA / step':>12}"
            )
            for row in result["step"].values():
                kern = row["ours_lora_kernels"]
                print(
                    f"{'':<49}{row['K']:>2} {row['r']:>3} {row['floor']:>+8.2%} {kern['lora_over_base']:>+30.2%} "
                    f"{kern['over_floor']:>8.2f} {kern['lora_over_step']:>+12.2%}"
                )
    s = result["switch"]
    if s:
        print(
            f"\nAdapter switch (step: ours {s['step_s_ours']:.3f}s, diffusers {s['step_s_diffusers']:.3f}s)"
        )
        print(f"{'case':<44}{'time ms':>10}{'of step':>10}{'vs diffusers':>14}")
        print(
            f"{'ours, adapter already in a device slot':<44}{s['ours_resident_s'] * 1e3:>10.3f}{s['ours_resident_frac_of_step']:>10.4f}{s['speedup_resident']:>13.1f}x"
        )
        print(
            f"{'ours, host cache -> device slot write':<44}{s['ours_slot_write_s'] * 1e3:>10.3f}{s['ours_slot_write_frac_of_step']:>10.4f}{s['speedup_slot_write']:>13.1f}x"
        )
        print(
            f"{'diffusers set_adapters':<44}{s['diffusers_set_adapters_s'] * 1e3:>10.3f}{s['diffusers_frac_of_step']:>10.4f}{1.0:>13.1f}x"
        )
        print(
            f"with {s['registered_many']} adapters registered: resident {s['ours_resident_many_s'] * 1e3:.3f} ms "
            f"(x{s['flat_ratio_resident']:.2f} vs 2), slot write {s['ours_slot_write_many_s'] * 1e3:.3f} ms "
            f"(x{s['flat_ratio_slot_write']:.2f} vs {s['registered_few']['slot_write']})"
        )
    b = result["batch"]
    if b:
        print(
            f"\nBatch of 4 requests / 4 adapters: {b['batch4_s']:.3f}s vs one by one {b['one_by_one_s']:.3f}s "
            f"(ratio {b['ratio']:.3f}; without LoRA {b['base_ratio']:.3f})"
        )
    m = result["memory"]
    if m:
        print(
            f"\nHost cache, {m['adapters']} adapters: files {m['file_bytes'] / 2**20:.1f} MiB, cache tensors "
            f"{m['cache_tensor_bytes'] / 2**20:.1f} MiB (x{m['cache_over_files']:.3f}), RSS +{m['rss_delta_bytes'] / 2**20:.1f} MiB, "
            f"peak +{m['rss_peak_delta_bytes'] / 2**20:.1f} MiB (x{m['rss_peak_over_files']:.3f})"
        )
    out = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": device,
            "clock": args.clock,
        },
        "command": "python -m benchmarks.diffusion_lora "
        + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "model": {**cfg, "image_tokens": image_tokens, "caption_tokens": cap_tokens, "dtype": str(dtype)},
        "base_max_abs_diff_ours_vs_diffusers": err,
        "results": result,
        "wall_s": time.perf_counter() - t0,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.json} ({out['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
