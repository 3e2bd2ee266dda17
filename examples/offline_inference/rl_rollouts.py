"""RL-style rollouts: train a LoRA policy with peft, hand each step's adapter to ``Omni`` in memory.

Every training step (a peft + torch optimizer step on the policy) is followed by rollouts through
``Omni`` with that step's adapter, handed over as a ``TensorLoRARequest`` built the way RL
frameworks (verl) build it: ``peft_config=LoraConfig(...).to_dict()`` and
``lora_tensors=get_peft_model_state_dict(model)``. No adapter file is written. Two policies:

* the tiny LLM (a causal-LM loss on a fixed continuation); each rollout is checked token for token
  against transformers+peft on the policy's weights at that step;
* the demo diffusion model shipped in ``examples/demo_model`` (a flow-matching loss of its denoiser's
  LoRA towards fixed latents, as FlowGRPO-style trainers update a DiT); each rollout's final latents are
  checked against diffusers' ``ZImagePipeline`` running the policy (within 1e-4).

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
DIFFUSION_PROMPTS = ["a red circle on a blue background", "a green square"]
DEMO = REPO / "examples" / "demo_model"
TARGET = " jumps over the lazy dog"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="LLM directory (default: the tiny test model)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (one adapter hand-over each)")
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--diffusion-steps", type=int, default=2, help="optimizer steps of the demo DiT's LoRA")
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


def build_dit_policy(demo_dir: str):
    """The trainer's side for the diffusion model: diffusers' pipeline in float32 whose denoiser carries a
    fresh LoRA (peft, injected in place: the pipeline runs the policy's current weights) and its captions."""
    import torch
    from diffusers import ZImagePipeline
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    pipe = ZImagePipeline.from_pretrained(demo_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"], lora_dropout=0.0)
    policy = get_peft_model(pipe.transformer, config)
    with torch.no_grad():
        captions, _ = pipe.encode_prompt(DIFFUSION_PROMPTS, do_classifier_free_guidance=False)
    return pipe, policy, captions


def flow_step(policy, optimizer, captions, step: int) -> float:
    """One flow-matching step of the denoiser's LoRA towards fixed random latents (a stand-in for a reward)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(100 + step)
    x0 = torch.randn(len(captions), 16, 8, 8, generator=torch.Generator().manual_seed(7))
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.rand(len(captions), generator=g)
    xt = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
    policy.train()
    out = policy(list(xt.unsqueeze(2).unbind(0)), 1 - sigma, list(captions), return_dict=False)[0]
    loss = F.mse_loss(torch.stack(out).squeeze(2), x0 - noise)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    policy.eval()
    return float(loss.detach())


def diffusion_rollouts(demo_dir: str, steps: int, lr: float) -> bool:
    """Train the demo model's denoiser LoRA; after each step a rollout through ``Omni`` with the step's adapter
    in memory, compared with diffusers' pipeline running the policy (latents within 1e-4)."""
    import torch
    from peft import get_peft_model_state_dict

    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.lora.request import TensorLoRARequest

    pipe, policy, captions = build_dit_policy(demo_dir)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr)
    sp = dict(height=64, width=64, num_inference_steps=4, guidance_scale=0.0)
    ok = True
    with Omni(demo_dir, dtype="float32", enable_progress_bar=False) as omni:
        for step in range(1, steps + 1):
            loss = flow_step(policy, optimizer, captions, step)
            adapter = TensorLoRARequest(
                lora_name="dit_policy",
                lora_int_id=2,
                peft_config=policy.peft_config["default"].to_dict(),
                lora_tensors=get_peft_model_state_dict(policy),
            )
            params = OmniDiffusionSamplingParams(**sp, seed=step, output_type="latent")
            ours = omni.generate(DIFFUSION_PROMPTS[0], params, lora_request=adapter)[0].latents
            with torch.inference_mode():
                theirs = pipe(
                    DIFFUSION_PROMPTS[0],
                    **sp,
                    generator=torch.Generator().manual_seed(step),
                    output_type="latent",
                ).images
            diff = (ours - theirs).abs().max().item()
            base = omni.generate(DIFFUSION_PROMPTS[0], params)[0].latents
            acts = (ours - base).abs().max().item() > 1e-3  # the step's adapter changed the rollout
            ok &= diff <= 1e-4 and acts
            print(
                f"diffusion step {step}: loss {loss:.4f}, adapter acts: {acts}, "
                f"rollout equals diffusers+peft: {diff <= 1e-4} ({diff:.1e})"
            )
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from peft import get_peft_model_state_dict

    import vllm_omni  # noqa: F401 - before vLLM: its known start-up noise is said once (vllm_omni/log_noise.py)

    # isort: split
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
    if args.diffusion_steps:
        ok &= diffusion_rollouts(str(DEMO), args.diffusion_steps, lr=1e-2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
