"""An adapter whose update overflows the LoRA dtype is refused when loaded (issue 13, item 2).

alpha 3e38 or B x 1e30 are finite in float32 but turn every image of the batch black (inf / NaN
after the layers that square their inputs); A = 3e38 with B = 0 adds nothing on paper, but its
shrink ``x A^T`` is inf and ``inf * 0`` is NaN (a compiled stage's bank multiplies every resident
slot for every row, so it reached rows that did not use the adapter). The manager refuses them
naming the file and the layer, and its cache and slots stay as they were.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from lora_toy_models import inputs, make_vllm_dit
from safetensors.torch import load_file, save_file

from vllm_omni.diffusion.lora import DiffusionLoRAManager
from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.request import LoRARequest


def _variant(src: str, dst: str, *, alpha=None, b_factor=None, a_value=None) -> str:
    shutil.copytree(src, dst)
    if alpha is not None:
        cfg_path = os.path.join(dst, "adapter_config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["lora_alpha"] = alpha
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    if b_factor is not None or a_value is not None:
        weights = os.path.join(dst, "adapter_model.safetensors")
        tensors = load_file(weights)
        if b_factor is not None:
            tensors = {k: v * b_factor if "lora_B" in k else v for k, v in tensors.items()}
        if a_value is not None:
            tensors = {k: torch.full_like(v, a_value) if "lora_A" in k else v for k, v in tensors.items()}
        save_file(tensors, weights)
    return dst


@pytest.mark.parametrize(
    "kind, dtype",
    [
        (dict(alpha=3e38), torch.float32),
        (dict(b_factor=1e30), torch.float32),
        (dict(alpha=3e38), torch.bfloat16),
        (dict(b_factor=1e30), torch.bfloat16),
        (dict(a_value=3e38, b_factor=0.0), torch.float32),
        (dict(a_value=3e38, b_factor=0.0), torch.bfloat16),
    ],
)
def test_overflowing_adapter_is_refused_and_the_cache_is_unchanged(toy_base, adapters, tmp_path, kind, dtype):
    model = make_vllm_dit(toy_base.state_dict())
    manager = DiffusionLoRAManager(model, max_loras=2, max_rank=8, dtype=dtype)
    good = LoRARequest("a", 1, adapters["a"][0])
    manager.add_lora(good)
    x, c = inputs()
    with manager.activate([[good]], [[1.0]]):
        before = model(x, c)
    bad_path = _variant(adapters["a"][0], str(tmp_path / "bad"), **kind)
    with pytest.raises(InvalidAdapterError) as info:
        manager.add_lora(LoRARequest("bad", 2, bad_path))
    message = str(info.value)
    assert bad_path in message and "layer " in message and str(dtype) in message, message
    assert manager.list_loras() == [1] and manager.cache_entry(2) is None
    with manager.activate([[good]], [[1.0]]):
        after = model(x, c)
    assert torch.equal(before, after) and torch.isfinite(after).all()


def test_ordinary_adapters_still_load_in_bfloat16(toy_base, adapters):
    model = make_vllm_dit(toy_base.state_dict())
    manager = DiffusionLoRAManager(model, max_loras=2, max_rank=8, dtype=torch.bfloat16)
    for i, name in enumerate(("a", "b", "rs", "pattern")):
        assert manager.add_lora(LoRARequest(name, i + 1, adapters[name][0]))
