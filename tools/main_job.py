"""The main job: one prompt through ``Omni`` on an LLM stage and on a diffusion stage.

1. LLM stage: builds the tiny Qwen2 model and its two PEFT adapters (random weights,
   real formats) under ``--assets`` if they are absent, starts one real vLLM engine
   through ``Omni(...)`` with LoRA enabled, and prints the greedy continuation of the
   prompt with adapter A, adapter B and no adapter.
2. Diffusion stage: generates an image with ``Omni(model=<diffusers directory>)`` and
   writes it as a PNG (``--image-model``; default: the tiny Z-Image directory written
   by ``tools/make_tiny_diffusion.py``).

Run from the repository root::

    .venv/bin/python -m tools.main_job [--prompt TEXT] [--assets DIR] [--image-model DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="the quick brown fox")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument(
        "--assets", default=os.environ.get("VLLM_OMNI_TEST_ASSETS") or str(REPO / ".cache" / "test_assets")
    )
    p.add_argument("--image-model", default=None, help="diffusers-format directory (default: tiny Z-Image)")
    p.add_argument("--image-prompt", default="a red circle")
    p.add_argument("--out", default=str(REPO / "outputs"))
    return p.parse_args(argv)


def run_image(args) -> Path:
    """Generate one image through ``Omni`` on a diffusion stage and write it as a PNG."""
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    model = args.image_model or str(ensure_tiny_diffusion_assets(args.assets)["z_image"])
    params = OmniDiffusionSamplingParams(
        height=64, width=64, num_inference_steps=8, guidance_scale=1.0, seed=0
    )
    with Omni(model=model, enable_progress_bar=False) as omni:
        (out,) = omni.generate(prompt=args.image_prompt, sampling_params=params)
    path = Path(args.out) / "main_job.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    out.images[0].save(path)
    print(
        f"\nimage: {args.image_prompt!r} with {model} -> {path} ({out.images[0].size[0]}x{out.images[0].size[1]})"
    )
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from vllm import SamplingParams

    from tools.make_tiny_llm import ensure_tiny_llm_assets
    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    t0 = time.perf_counter()
    assets = ensure_tiny_llm_assets(args.assets)
    print(
        f"[main job] tiny model and adapters ready in {assets.model_dir.parent} ({time.perf_counter() - t0:.1f} s)"
    )

    adapters = {
        "adapter A (r=8, q/v)": LoRARequest("adapter_a", 1, str(assets.adapter_a)),
        "adapter B (r=16, all linear)": LoRARequest("adapter_b", 2, str(assets.adapter_b)),
        "no adapter": None,
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with Omni(
        str(assets.model_dir),
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        max_model_len=256,
        dtype="float32",
    ) as omni:
        outputs = omni.generate([args.prompt] * len(adapters), params, lora_request=list(adapters.values()))
    print(f"\nprompt: {args.prompt!r}")
    for label, out in zip(adapters, outputs):
        print(f"  {label:<30} -> {out.text!r}  token ids {out.token_ids}")
    run_image(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
