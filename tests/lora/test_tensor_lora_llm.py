"""Adapters handed over in memory on a real LLM stage (issue 40): ``TensorLoRARequest`` built the way
RL trainers build it (``LoraConfig(...).to_dict()`` + ``get_peft_model_state_dict``) serves exactly the
trainer's weights of that step, compared token for token with transformers+peft on the same tensors
(float32), on a ~300-token prompt with vLLM's prefix cache on (a stale version would reuse KV blocks).
Bad input is refused at ``add_lora`` naming the key, and the previous version keeps serving."""

from __future__ import annotations

import math

import pytest
import torch
from vllm import SamplingParams

from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.request import TensorLoRARequest

N = 4
PROMPT_IDS = [10 + (i * 37) % 480 for i in range(300)]  # several full prefix-cache blocks
SHORT_IDS = PROMPT_IDS[:12]
STEPS = 5

pytestmark = pytest.mark.engine


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


class Policy:
    """A peft policy on the tiny LLM (float32): the 'trainer' and the transformers+peft reference."""

    def __init__(self, model_dir, seed: int = 0, alpha: int = 16):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=8, lora_alpha=alpha, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        self.model = get_peft_model(base, config).eval()
        self.config = config.to_dict()
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        """A new random policy in place (as an optimizer step updates the trainer's tensors)."""
        with torch.no_grad():
            for name, p in sorted(self.model.named_parameters()):
                if ".lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=self.gen) * 0.15)

    def tensors(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.model)

    @torch.inference_mode()
    def greedy(self, ids: list[int], n: int = N) -> list[int]:
        seq = list(ids)
        for _ in range(n):
            seq.append(int(self.model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        return seq[len(ids) :]


@pytest.fixture(scope="module")
def omni(tiny_llm_assets):
    from vllm_omni import Omni

    engine = Omni(
        str(tiny_llm_assets.model_dir),
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        enable_prefix_caching=True,
        max_model_len=512,
        dtype="float32",
        max_num_seqs=4,
    )
    yield engine
    engine.shutdown()


def test_each_update_serves_that_steps_weights(omni, tiny_llm_assets, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written: checked below
    policy = Policy(tiny_llm_assets.model_dir)
    seen = set()
    for step in range(STEPS):
        policy.step()
        lora = TensorLoRARequest(
            lora_name="policy",
            lora_int_id=7,
            peft_config=policy.config,
            lora_tensors=policy.tensors(),
            load_inplace=step == 3,  # vLLM's in-place reload flag: a new version all the same
        )
        expected = policy.greedy(PROMPT_IDS)
        seen.add(tuple(expected))
        if step % 2:  # registered (the verl way) or handed over with the request only
            assert omni.add_lora(lora)
        out = omni.generate([PROMPT_IDS, SHORT_IDS], greedy(), lora_request=lora)
        assert list(out[0].token_ids) == expected, f"step {step}"
        assert list(out[1].token_ids) == policy.greedy(SHORT_IDS), f"step {step}"
        # the trainer updates its tensors in place after the hand-over: the request holds a copy
        with torch.no_grad():
            next(p for n, p in policy.model.named_parameters() if "lora_B" in n).add_(1.0)
        assert list(omni.generate(PROMPT_IDS, greedy(), lora_request=lora)[0].token_ids) == expected
    assert len(seen) > 1  # the steps' policies differ in their outputs
    assert omni.adapter_registry.get("policy").version == STEPS - 1  # registered at step 1, then one per step
    assert omni.list_loras() <= {7}
    assert list(tmp_path.iterdir()) == []


def _good(policy: Policy) -> tuple[dict, dict[str, torch.Tensor]]:
    return dict(policy.config), {k: v.clone() for k, v in policy.tensors().items()}


def test_bad_tensors_are_refused_at_add_lora_and_the_previous_version_serves(omni, tiny_llm_assets):
    policy = Policy(tiny_llm_assets.model_dir, seed=5)
    policy.step()
    config, tensors = _good(policy)
    good = TensorLoRARequest(lora_name="bad", lora_int_id=9, peft_config=config, lora_tensors=tensors)
    assert omni.add_lora(good)
    expected = policy.greedy(PROMPT_IDS)
    key = sorted(k for k in tensors if "q_proj.lora_A" in k)[0]
    wrong_shape = {**tensors, key: torch.zeros(8, 64)}
    nan = {**tensors, key: tensors[key].clone().index_fill_(1, torch.tensor([0]), math.nan)}
    cases = [
        ({**config, "r": 4}, tensors, "rank"),  # tensors do not match the config
        (config, wrong_shape, "q_proj"),  # do not match the model
        (config, nan, "NaN"),
        (
            {**config, "r": 32, "lora_alpha": 32},
            {
                k: torch.zeros(32, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 32)
                for k, v in tensors.items()
            },
            "max_lora_rank",
        ),  # fmt: skip
    ]
    for cfg, bad, needle in cases:
        with pytest.raises(InvalidAdapterError, match=needle):
            omni.add_lora(
                TensorLoRARequest(lora_name="bad", lora_int_id=9, peft_config=cfg, lora_tensors=bad)
            )
        assert list(omni.generate(PROMPT_IDS, greedy(), lora_request=good)[0].token_ids) == expected
    with pytest.raises(InvalidAdapterError, match="not LoRA"):
        TensorLoRARequest(
            lora_name="x", lora_int_id=3, peft_config={**config, "peft_type": "LOHA"}, lora_tensors=tensors
        )
    with pytest.raises(InvalidAdapterError, match="lora_tensors"):
        TensorLoRARequest(
            lora_name="x", lora_int_id=3, peft_config=config, lora_tensors={"a.lora_A.weight": [1.0]}
        )
    assert omni.adapter_registry.get("bad").version == 1
    omni.remove_lora(9)


def test_evicted_in_memory_adapter_reloads_unscaled(omni, tiny_llm_assets):
    """Issue 46: vLLM's loader folds ``lora_alpha / r`` into ``lora_B`` in place (``optimize``) and its
    ``.to()`` returns the tensor it is given: an in-memory adapter (r 8, alpha 32: x4) evicted from the
    engine's cache (``max_cpu_loras`` 2) and loaded again must be served peft's tokens every time, not
    ``lora_B`` x4, x16, ... and the stage's held copy must stay the caller's values."""
    from vllm_omni.engine import tensor_lora

    policy = Policy(tiny_llm_assets.model_dir, seed=11, alpha=32)
    policy.step()
    lora = TensorLoRARequest(
        lora_name="rollout", lora_int_id=21, peft_config=policy.config, lora_tensors=policy.tensors()
    )
    original = {k: v.clone() for k, v in lora.lora_tensors.items()}
    expected = policy.greedy(SHORT_IDS)
    others = []
    for i, seed in enumerate((12, 13)):
        other = Policy(tiny_llm_assets.model_dir, seed=seed, alpha=32)
        other.step()
        others.append(
            TensorLoRARequest(
                lora_name=f"other{i}",
                lora_int_id=22 + i,
                peft_config=other.config,
                lora_tensors=other.tensors(),
            )
        )
    for reload in range(5):
        out = omni.generate(SHORT_IDS, greedy(), lora_request=lora)
        assert list(out[0].token_ids) == expected, f"load {reload}"
        for other in others:  # two other adapters: the engine's CPU cache (2 entries) evicts 'rollout'
            omni.generate(SHORT_IDS, greedy(), lora_request=other)
        assert 21 not in omni.list_loras()
    held = tensor_lora.held(omni.adapter_registry.by_id(21).engine.lora_path)
    for key, value in original.items():
        assert torch.equal(held.lora_tensors[key], value), key
    for lora_int_id in (21, 22, 23):
        omni.remove_lora(lora_int_id)
