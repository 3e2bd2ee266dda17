"""Reference greedy decoding of a tiny Omni thinker (Qwen2.5-Omni, Qwen3-Omni) with transformers (+ peft), float32."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=4)
def thinker(model_dir: str, adapter_dir: str | None = None, layout: str = "full"):
    """transformers' thinker of the checkpoint (the class its ``config.json`` names), with the
    adapter applied by peft.

    ``layout="full"``: peft on the whole model (adapter keys ``...thinker.model.layers...``);
    ``"thinker"``: peft on the thinker sub-model alone (keys ``...model.layers...``).
    """
    import transformers

    (arch,) = transformers.AutoConfig.from_pretrained(model_dir).architectures
    full = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        PeftModel.from_pretrained(full if layout == "full" else full.thinker, adapter_dir)
    return full.thinker.eval()


@torch.inference_mode()
def thinker_greedy(
    model_dir: str | os.PathLike,
    prompt_ids: list[int],
    max_new_tokens: int,
    adapter_dir: str | os.PathLike | None = None,
    layout: str = "full",
) -> list[int]:
    """Greedy-decode ``max_new_tokens`` tokens after ``prompt_ids`` (no stop); the new ids."""
    model = thinker(str(model_dir), None if adapter_dir is None else str(adapter_dir), layout)
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt_ids) :].tolist()
