"""Reference (transformers / PEFT) greedy decoding for the tiny test LLM.

Used to check that vLLM outputs (with and without LoRA) match an independent
implementation token for token. Everything runs in float32 on CPU.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


@functools.lru_cache(maxsize=8)
def _load(model_dir: str, adapter_dir: str | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        # PeftModel injects LoRA layers into `model` in place, hence one base copy per adapter.
        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@functools.lru_cache(maxsize=2)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _key(path: str | os.PathLike | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def encode(model_dir: str | os.PathLike, prompt: str) -> list[int]:
    """Prompt token ids as vLLM computes them for a text prompt (no special tokens are added)."""
    return _tokenizer(_key(model_dir)).encode(prompt, add_special_tokens=False)


@torch.inference_mode()
def hf_logits(
    model_dir: str | os.PathLike, token_ids: list[int], adapter_dir: str | os.PathLike | None = None
) -> torch.Tensor:
    """Next-token logits (float32, shape [vocab]) after ``token_ids``."""
    model = _load(_key(model_dir), _key(adapter_dir))
    return model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0, -1].float()


def hf_greedy(
    model_dir: str | os.PathLike,
    prompt: str | list[int],
    max_new_tokens: int,
    adapter_dir: str | os.PathLike | None = None,
) -> list[int]:
    """Greedy-decode ``max_new_tokens`` tokens; return only the new token ids.

    ``prompt`` is a text (tokenized without special tokens, like vLLM does for this
    tokenizer, which has no BOS) or a list of token ids. EOS does not stop decoding
    (compare with vLLM's ``ignore_eos=True``). Results are cached in-process.
    """
    ids = tuple(prompt) if not isinstance(prompt, str) else tuple(encode(model_dir, prompt))
    return list(_greedy(_key(model_dir), ids, max_new_tokens, _key(adapter_dir)))


@functools.lru_cache(maxsize=256)
@torch.inference_mode()
def _greedy(model_key: str, ids: tuple[int, ...], max_new_tokens: int, adapter_key: str | None):
    # The full sequence is re-run at each step (no KV cache): simple, and the model is tiny.
    model = _load(model_key, adapter_key)
    seq = list(ids)
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
        seq.append(int(torch.argmax(logits)))
    return tuple(seq[len(ids) :])


@torch.inference_mode()
def hf_logprobs(
    model_dir: str | os.PathLike,
    prompt_ids: list[int],
    generated_ids: list[int],
    adapter_dir: str | os.PathLike | None = None,
) -> torch.Tensor:
    """Log-probabilities (float32, natural log, shape ``[len(generated_ids), vocab]``) of the next
    token at each generated position: row ``i`` is the distribution ``generated_ids[i]`` was drawn
    from (after ``prompt_ids + generated_ids[:i]``), from one forward pass without a KV cache."""
    model = _load(_key(model_dir), _key(adapter_dir))
    seq = list(prompt_ids) + list(generated_ids)
    logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start : start + len(generated_ids)], dim=-1)
