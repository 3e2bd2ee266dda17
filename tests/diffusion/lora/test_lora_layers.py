"""The LoRA layer registry: each vLLM linear layer kind gets its own ``*WithLoRA`` class.

(The import rule that keeps LoRA code out of the models is in tests/test_import_rules.py.)
"""

from __future__ import annotations

import torch.nn as nn
from lora_toy_models import make_torch_dit, make_vllm_dit

from vllm_omni.diffusion.lora import DiffusionLoRAManager
from vllm_omni.diffusion.lora.layers import (
    ColumnParallelLinearWithLoRA,
    LinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    ReplicatedLinearWithLoRA,
    RowParallelLinearWithLoRA,
    wrapper_class_for,
)


def test_each_layer_kind_gets_its_own_class():
    torch_model = make_torch_dit(n_blocks=1)
    vllm_model = make_vllm_dit(torch_model.state_dict(), n_blocks=1)
    kinds = {
        name: type(layer) for name, layer in DiffusionLoRAManager(vllm_model, max_loras=1).wrappers.items()
    }
    assert kinds == {
        "blocks.0.adaLN": ReplicatedLinearWithLoRA,
        "blocks.0.attn.to_qkv": QKVParallelLinearWithLoRA,
        "blocks.0.attn.to_out.0": RowParallelLinearWithLoRA,
        "blocks.0.ff.w13": MergedColumnParallelLinearWithLoRA,
        "blocks.0.ff.w2": RowParallelLinearWithLoRA,
    }
    assert {type(w) for w in DiffusionLoRAManager(torch_model, max_loras=1).wrappers.values()} == {
        LinearWithLoRA
    }
    # a wrapped layer, or a module that is no linear layer, is left alone
    assert wrapper_class_for(vllm_model.blocks[0].adaLN) is None
    assert wrapper_class_for(nn.LayerNorm(4)) is None
    assert issubclass(QKVParallelLinearWithLoRA, ColumnParallelLinearWithLoRA)
