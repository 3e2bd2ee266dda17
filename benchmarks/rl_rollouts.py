"""RL rollouts: adapter update-to-first-answer latency (in memory vs files) and the merged fast path, in one run.

An RL trainer pushes a new adapter every step and generates with it at once. Measured through ``Omni`` on
the tiny test models (real formats, random weights), both stage kinds:

1. **update to first answer**: from the trainer's updated peft model to the first answer served with it:
   ``TensorLoRARequest`` (``get_peft_model_state_dict`` + ``LoraConfig.to_dict()``, copied and hashed)
   against files (``save_pretrained`` into a folder, then ``add_lora`` with ``reload=True``), each followed by
   ``add_lora`` and one request (LLM: 1 token on a 64-token prompt; diffusion: 1 step at 32x32). ``--updates``
   updates per side, interleaved; the ratio is files / tensors (> 1: in memory is faster). On the LLM
   stage every answer is also checked against transformers+peft on that update's weights (``exact_updates``).
2. **step time**: a diffusion request (``--steps`` steps, 32x32, no CFG) on the base model, with one adapter
   un-merged (``lora_merge=False``) and merged (``lora_merge=True``, a second engine), interleaved; ratios
   to the base step.

Times are this process's CPU time (every engine runs in it; see benchmarks/timing.py), medians.

    .venv/bin/python -m benchmarks.rl_rollouts            # 20 updates, 8 steps, 9 repeats
    .venv/bin/python -m benchmarks.rl_rollouts --quick    # 5 updates, 3 repeats (smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from benchmarks.timing import Timer, median

REPO = Path(__file__).resolve().parent.parent


def _perturb(model, gen) -> None:
    import torch

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _policy(base_loader, targets: list[str], r: int, alpha: float):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        base_loader(), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    )


def _update_latency(timer: Timer, omni, policy, run_one, updates: int, name: str, check=None) -> dict:
    """Median seconds from an updated policy to its first answer, in memory and through files; with
    ``check(output) -> bool`` (the answer equals the reference on the policy's weights of that update),
    how many timed updates of each side served exactly that update's weights."""
    import torch
    from peft import get_peft_model_state_dict

    from vllm_omni.lora.request import LoRARequest, TensorLoRARequest

    config = policy.peft_config["default"].to_dict()
    folder = Path(tempfile.mkdtemp(prefix=f"rl-{name}-"))
    file_lora = LoRARequest(f"{name}_files", 2, str(folder))
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"tensors": [], "files": []}
    exact = {"tensors": 0, "files": 0}
    answers: list = []

    def by_tensors() -> None:
        lora = TensorLoRARequest(
            lora_name=f"{name}_tensors",
            lora_int_id=1,
            peft_config=config,
            lora_tensors=get_peft_model_state_dict(policy),
        )
        omni.add_lora(lora)
        answers.append(run_one(lora))

    def by_files() -> None:
        policy.save_pretrained(str(folder))
        omni.add_lora(file_lora, reload=True)
        answers.append(run_one(file_lora))

    for i in range(updates + 1):  # the first round warms both paths up (not counted)
        for side, fn in (
            (("tensors", by_tensors), ("files", by_files))
            if i % 2
            else (("files", by_files), ("tensors", by_tensors))
        ):
            _perturb(policy, gen)
            spent = timer(fn)
            if i:
                times[side].append(spent)
                exact[side] += bool(check and check(answers[-1]))
    out = {side: median(values) for side, values in times.items()}
    if check is not None:
        out["exact_updates"] = {side: f"{n}/{updates}" for side, n in exact.items()}
    out["files_over_tensors"] = out["files"] / out["tensors"]
    return out


def _llm(timer: Timer, updates: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from tools.make_tiny_llm import ensure_tiny_llm_assets
    from vllm_omni import Omni

    model = str(ensure_tiny_llm_assets(REPO / ".cache" / "test_assets").model_dir)
    omni = Omni(model, enable_lora=True, max_lora_rank=16, max_loras=2, max_model_len=256, dtype="float32")
    policy = _policy(
        lambda: AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), ["q_proj", "v_proj"], 8, 16
    )
    prompt = [10 + (i * 37) % 480 for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def check(outputs) -> bool:  # transformers+peft's greedy token on the policy's current weights
        with torch.inference_mode():
            return outputs[0].token_ids[0] == int(
                policy(input_ids=torch.tensor([prompt])).logits[0, -1].argmax()
            )

    try:
        return _update_latency(
            timer,
            omni,
            policy,
            lambda lora: omni.generate(prompt, params, lora_request=lora),
            updates,
            "llm",
            check,
        )
    finally:
        omni.shutdown()


def _diffusion(timer: Timer, updates: int, steps: int, repeats: int) -> dict:
    from diffusers import ZImageTransformer2DModel

    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.lora.request import TensorLoRARequest

    z_dir = str(ensure_tiny_diffusion_assets(REPO / ".cache" / "test_assets")["z_image"])
    targets = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
    policy = _policy(
        lambda: ZImageTransformer2DModel.from_pretrained(z_dir, subfolder="transformer"), targets, 8, 8
    )

    def params(n: int) -> OmniDiffusionSamplingParams:
        return OmniDiffusionSamplingParams(
            height=32, width=32, num_inference_steps=n, guidance_scale=0.0, seed=1, output_type="latent"
        )

    engines = {
        m: Omni(model=z_dir, dtype="float32", enable_progress_bar=False, lora_merge=m) for m in (False, True)
    }
    try:
        plain = engines[False]
        out = {
            "update": _update_latency(
                timer,
                plain,
                policy,
                lambda lora: plain.generate("a cat", params(1), lora_request=lora),
                updates,
                "dit",
            )
        }
        from peft import get_peft_model_state_dict

        lora = TensorLoRARequest(
            lora_name="policy",
            lora_int_id=5,
            peft_config=policy.peft_config["default"].to_dict(),
            lora_tensors=get_peft_model_state_dict(policy),
        )
        runs = {
            "base": lambda: plain.generate("a cat", params(steps)),
            "unmerged": lambda: plain.generate("a cat", params(steps), lora_request=lora),
            "merged": lambda: engines[True].generate("a cat", params(steps), lora_request=lora),
        }
        for fn in runs.values():
            fn()  # warm-up (the merged engine merges here, once)
        times = {k: [] for k in runs}
        for _ in range(repeats):
            for k, fn in runs.items():
                times[k].append(timer(fn) / steps)
        step = {k: median(v) for k, v in times.items()}
        out["step_s"] = step
        out["unmerged_over_base"] = step["unmerged"] / step["base"]
        out["merged_over_base"] = step["merged"] / step["base"]
        out["merged_over_unmerged"] = step["merged"] / step["unmerged"]
        return out
    finally:
        for engine in engines.values():
            engine.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="5 updates, 3 repeats")
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "rl_rollouts.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.updates, args.repeats = 5, 3
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(1)
    timer = Timer("cpu", "cpu")
    result = {
        "machine": platform.processor() or platform.machine(),
        "args": vars(args),
        "llm": _llm(timer, args.updates),
        "diffusion": _diffusion(timer, args.updates, args.steps, args.repeats),
    }
    print(json.dumps(result, indent=1))
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
