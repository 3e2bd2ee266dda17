"""The main job: one prompt through ``Omni`` on an LLM stage and on a diffusion stage.

1. LLM stage: builds the tiny Qwen2 model and its two PEFT adapters (random weights,
   real formats) under ``--assets`` if they are absent, starts one real vLLM engine
   through ``Omni(...)`` with LoRA enabled, and prints the greedy continuation of the
   prompt with adapter A, adapter B and no adapter.
2. Diffusion stage: generates a 3x3 grid with ``Omni`` on the demo model shipped in
   ``examples/demo_model`` (a tiny Z-Image-architecture model trained on coloured
   shapes), composing its ``warm`` and ``stripes`` adapters at scales 0 / 0.5 / 1, and
   writes it as a PNG (``--out``/demo_grid.png).

Run from the repository root::

    .venv/bin/python -m tools.main_job [--prompt TEXT] [--assets DIR] [--image-model DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
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
    p.add_argument(
        "--image-model", default=None, help="diffusers-format directory (default: examples/demo_model)"
    )
    p.add_argument("--image-prompt", default="a blue circle")
    p.add_argument("--out", default=str(REPO / "outputs"))
    return p.parse_args(argv)


def run_image(args) -> Path:
    """Generate the demo XY grid through ``Omni`` on a diffusion stage and write it as a PNG.

    The demo model (``examples/demo_model``, trained by ``tools/train_demo_model.py``) and
    its two adapters are composed per request at scales 0 / 0.5 / 1 on each axis, by
    ``examples/offline_inference/text_to_image/text_to_image.py``.
    """
    import importlib.util

    script = REPO / "examples" / "offline_inference" / "text_to_image" / "text_to_image.py"
    spec = importlib.util.spec_from_file_location("text_to_image_example", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    adapters = REPO / "examples" / "demo_model" / "adapters"
    path = Path(args.out) / "demo_grid.png"
    argv = ["--prompt", args.image_prompt, "--output", str(path)]
    argv += ["--lora-paths", str(adapters / "warm"), str(adapters / "stripes")]
    argv += ["--axis", "x=lora_scale[0]:0,0.5,1", "y=lora_scale[1]:0,0.5,1"]
    if args.image_model:
        argv += ["--model", args.image_model]
    module.main(argv)
    print(
        f"\nimage grid: {args.image_prompt!r}, warm adapter scale across x stripes adapter scale down -> {path}"
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
