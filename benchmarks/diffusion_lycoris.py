"""LoHa / LoKr slots against a LoRA adapter of similar file size, measured in one run.

One random Z-Image transformer (``benchmarks.diffusion_assets``) with the in-tree model and
``DiffusionLoRAManager``; adapters on ``to_q to_k to_v to_out.0 w1 w2 w3`` of every block, written by
peft (``init_weights=False``: random factors):

* ``lora``: LoRA rank ``2 r``;
* ``loha``: LoHa rank ``r`` (two factor pairs: the same file size as ``lora``), served as rank ``r^2``;
* ``loha_dense``: the same LoHa file forced into the dense form (``dW`` with an identity factor),
  the alternative the loader rejects when the factorised form is smaller;
* ``lokr``: LoKr rank ``r`` with ``decompose_factor`` 4 (``w1`` 4 x 4 whole, ``w2`` factorised), served as
  rank ``4 r`` (its file is far smaller: LoKr is parameter-efficient by design).

Per adapter: file bytes, bytes held by its prepared slot weights (``cached_nbytes``), the largest
equivalent rank, and the step-time ratio with the adapter active / without (interleaved pairs, process
CPU time, one thread, medians of ``--repeats``).

Run from the repository root::

    .venv/bin/python -m benchmarks.diffusion_lycoris            # dim 1024, 4 + 1 + 1 blocks, 256 image tokens
    .venv/bin/python -m benchmarks.diffusion_lycoris --quick    # dim 512, smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from unittest import mock

from benchmarks.diffusion_assets import TARGETS, ensure_transformer, model_config
from benchmarks.timing import Timer, paired

REPO = Path(__file__).resolve().parent.parent


def _peft_adapter(folder: Path, out: Path, kind: str, r: int) -> Path:
    import peft
    from diffusers import ZImageTransformer2DModel

    if (out / "adapter_model.safetensors").is_file():
        return out
    configs = {
        "lora": lambda: peft.LoraConfig(
            r=2 * r, lora_alpha=2 * r, target_modules=TARGETS, init_lora_weights=False
        ),
        "loha": lambda: peft.LoHaConfig(r=r, alpha=r, target_modules=TARGETS, init_weights=False),
        "lokr": lambda: peft.LoKrConfig(
            r=r, alpha=r, target_modules=TARGETS, init_weights=False, decompose_factor=4
        ),
    }
    base = ZImageTransformer2DModel.from_pretrained(str(folder))
    peft.get_peft_model(base, configs[kind]()).save_pretrained(str(out))
    return out


def _measure(manager, reqs: dict, step, repeats: int) -> dict:
    """Per adapter: file and slot bytes, largest equivalent rank, step time with it / without."""
    timer = Timer("cpu", "cpu")
    out = {}
    for name, req in reqs.items():

        def activate(req=req):
            manager.set_active_adapters([req], [1.0])

        timing = paired(timer, {name: (step, manager.deactivate, activate)}, repeats, True)[name]
        held = manager.cache_entry(req.lora_int_id).payload
        out[name] = {
            "file_bytes": (Path(req.lora_path) / "adapter_model.safetensors").stat().st_size,
            "slot_bytes": manager.cached_nbytes(req.lora_int_id),
            "max_equivalent_rank": max(max(w.ranks) for w in held.values()),
            "step_base_s": timing["base_s"],
            "step_adapter_s": timing["lora_s"],
            "step_ratio": timing["ratio"],
        }
        manager.deactivate()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="dim 512, 2 layers, 2 repeats")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--latent", type=int, default=32, help="latent H = W (image tokens = (latent/2)^2)")
    p.add_argument("--rank", type=int, default=8, help="LoHa / LoKr rank r (LoRA gets 2 r)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--assets", default=str(REPO / ".cache" / "bench_assets"))
    p.add_argument("--json", default="benchmarks/results/diffusion_lycoris.json")
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.repeats = 512, 2, 2
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    cfg = model_config(args.dim, args.layers, 1, cap_dim=512)
    folder = ensure_transformer(Path(args.assets), cfg)
    adir = folder.parent / "lycoris"
    paths = {
        kind: _peft_adapter(folder, adir / f"{kind}_r{args.rank}", kind, args.rank)
        for kind in ("lora", "loha", "lokr")
    }

    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
    from vllm_omni.diffusion.lora import DiffusionLoRAManager
    from vllm_omni.diffusion.lora.formats import lycoris
    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel
    from vllm_omni.lora.request import LoRARequest

    init_diffusion_parallel_state(world_size=1, rank=0)
    model = ZImageTransformer2DModel.from_pretrained(folder, dtype=torch.float32, device="cpu")
    manager = DiffusionLoRAManager(model, max_loras=1, max_rank=2 * args.rank, max_cpu_loras=4)
    gen = torch.Generator().manual_seed(0)
    x = [torch.randn(16, 1, args.latent, args.latent, generator=gen)]
    cap = [torch.randn(64, cfg["cap_feat_dim"], generator=gen)]
    t = torch.tensor([0.5])

    reqs = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(paths.items())}
    reqs["loha_dense"] = LoRARequest("loha_dense", 9, str(paths["loha"]))
    for name, req in reqs.items():
        if name == "loha_dense":
            with mock.patch.object(lycoris, "cheapest_form", lycoris.dense_form):
                manager.add_lora(req)
        else:
            manager.add_lora(req)

    @torch.inference_mode()
    def step():
        return model(x, t, cap)

    result = {
        "machine": platform.processor() or platform.machine(),
        "config": {
            "dim": args.dim,
            "layers": args.layers,
            "image_tokens": (args.latent // 2) ** 2,
            "rank": args.rank,
        },
        "adapters": _measure(manager, reqs, step, args.repeats),
    }
    print(f"\nZ-Image dim {args.dim}, {args.layers}+1+1 blocks, fp32 CPU, 1 thread, median of {args.repeats}")
    print(f"{'adapter':<12}{'file MiB':>10}{'slot MiB':>10}{'eq. rank':>10}{'step ratio':>12}")
    for name, row in result["adapters"].items():
        print(
            f"{name:<12}{row['file_bytes'] / 2**20:>10.2f}{row['slot_bytes'] / 2**20:>10.2f}"
            f"{row['max_equivalent_rank']:>10}{row['step_ratio'] - 1:>+12.2%}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
