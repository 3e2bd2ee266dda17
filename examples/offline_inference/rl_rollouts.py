"""RL-style rollouts: train a LoRA policy with peft, hand each step's adapter to ``Omni`` in memory.

Every training step (a peft + torch optimizer step on the policy) is followed by rollouts through
``Omni`` with that step's adapter, handed over as a ``TensorLoRARequest`` built the way RL
frameworks (verl) build it: ``peft_config=LoraConfig(...).to_dict()`` and
``lora_tensors=get_peft_model_state_dict(model)``. No adapter file is written. Each rollout is
checked token for token against transformers+peft on the policy's weights at that step.

With no ``--model`` the tiny Qwen2 test model is built (seconds, random weights, real formats)
under ``--assets``; its text is gibberish but the check is exact::

    python examples/offline_inference/rl_rollouts.py --steps 3

The policy is trained to raise the likelihood of a fixed continuation (a stand-in for a reward).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["the quick brown fox", "once upon a time there was"]
TARGET = " jumps over the lazy dog"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="LLM directory (default: the tiny test model)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (one adapter hand-over each)")
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--assets",
        default=os.environ.get("VLLM_OMNI_TEST_ASSETS") or str(REPO / ".cache" / "test_assets"),
        help="where the tiny model is built when --model is not given",
    )
    return p.parse_args(argv)


def build_policy(model_dir: str):
    """The trainer's side: the base model in float32 with a fresh LoRA (peft), and its tokenizer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(base, config), AutoTokenizer.from_pretrained(model_dir)


def train_step(policy, optimizer, batch) -> float:
    """One optimizer step raising the likelihood of the target continuation; returns the loss."""

    policy.train()
    ids, labels = batch
    loss = policy(input_ids=ids, labels=labels).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    policy.eval()
    return float(loss.detach())


def reference_rollout(policy, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of transformers+peft on the policy's current weights (no KV cache; tiny model)."""
    import torch

    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(policy(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from peft import get_peft_model_state_dict
    from vllm import SamplingParams

    from vllm_omni import Omni
    from vllm_omni.lora.request import TensorLoRARequest

    model = args.model
    if model is None:
        sys.path.insert(0, str(REPO))
        from tools.make_tiny_llm import ensure_tiny_llm_assets

        model = str(ensure_tiny_llm_assets(args.assets).model_dir)
    policy, tokenizer = build_policy(model)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.lr)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    full = [p + tokenizer.encode(TARGET, add_special_tokens=False) for p in prompts]
    width = max(map(len, full))
    ids = torch.tensor([f + [0] * (width - len(f)) for f in full])
    labels = torch.tensor(
        [[-100] * len(p) + f[len(p) :] + [-100] * (width - len(f)) for p, f in zip(prompts, full)]
    )

    omni = Omni(model, enable_lora=True, max_lora_rank=16, max_model_len=256, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    config = policy.peft_config["default"].to_dict()
    ok = True
    for step in range(1, args.steps + 1):
        loss = train_step(policy, optimizer, (ids, labels))
        adapter = TensorLoRARequest(
            lora_name="policy",
            lora_int_id=1,
            peft_config=config,
            lora_tensors=get_peft_model_state_dict(policy),  # copied at hand-over
        )
        omni.add_lora(adapter)  # a new version of "policy": nothing of the previous step is served
        outputs = omni.generate(prompts, greedy, lora_request=adapter)
        match = all(
            list(o.token_ids) == reference_rollout(policy, p, args.max_tokens)
            for o, p in zip(outputs, prompts)
        )
        ok &= match
        print(f"step {step}: loss {loss:.4f}, version {omni.adapter_registry.get('policy').version}, "
              f"rollout {outputs[0].text!r}, equals transformers+peft: {match}")  # fmt: skip
    omni.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
