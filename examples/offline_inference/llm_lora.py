"""LoRA on an LLM stage through ``Omni``: the same prompts with different adapters in one batch.

With no ``--model`` the tiny Qwen2 test model and its two PEFT adapters are built (seconds,
random weights, real formats) under ``--assets`` and used; its text is gibberish, but every
adapter visibly changes it. With your own model pass ``--model`` and ``--lora-paths``::

    python examples/offline_inference/llm_lora.py
    python examples/offline_inference/llm_lora.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --lora-paths /path/to/adapter_a /path/to/adapter_b --max-lora-rank 64

Each prompt is run once per adapter and once without one; all of those requests go to
``Omni.generate`` together, so the engine batches requests with different adapters.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="LLM directory or hub id (default: the tiny test model)")
    p.add_argument(
        "--lora-paths", nargs="+", default=None, help="PEFT adapter folders (default: tiny A and B)"
    )
    p.add_argument("--prompt", action="append", default=None, help="repeatable (default: two prompts)")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--assets",
        default=os.environ.get("VLLM_OMNI_TEST_ASSETS") or str(REPO / ".cache" / "test_assets"),
        help="where the tiny model is built when --model is not given",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import vllm_omni  # noqa: F401 - before vLLM: its known start-up noise is said once (vllm_omni/log_noise.py)

    # isort: split

    from vllm import SamplingParams

    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    model, paths = args.model, args.lora_paths
    if model is None:
        import sys

        sys.path.insert(0, str(REPO))
        from tools.make_tiny_llm import ensure_tiny_llm_assets

        assets = ensure_tiny_llm_assets(args.assets)
        model = str(assets.model_dir)
        paths = paths or [str(assets.adapter_a), str(assets.adapter_b)]
    if not paths:
        raise SystemExit("--lora-paths is required with --model")
    prompts = args.prompt or ["the quick brown fox", "once upon a time"]
    adapters = [LoRARequest(Path(p).name, i + 1, str(p)) for i, p in enumerate(paths)]
    choices: list[LoRARequest | None] = [*adapters, None]

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with Omni(
        model,
        enable_lora=True,
        max_lora_rank=args.max_lora_rank,
        max_loras=len(adapters),
        max_model_len=args.max_model_len,
        dtype=args.dtype,
    ) as omni:
        batch = [(p, lr) for p in prompts for lr in choices]
        outputs = omni.generate(
            [p for p, _ in batch], params, lora_request=[lr for _, lr in batch], use_tqdm=False
        )
    for (prompt, lr), out in zip(batch, outputs, strict=True):
        label = lr.lora_name if lr is not None else "(no adapter)"
        print(f"{prompt!r:24} {label:14} -> {out.text!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
