"""Parity of the diffusion LoRA runtime against peft on the same weights (fp32, max abs err <= 1e-5)."""

from __future__ import annotations

import copy

import pytest
import torch
from lora_toy_models import DIM, KV_HEADS, inputs, make_vllm_dit

from vllm_omni.diffusion.lora import DiffusionLoRAManager
from vllm_omni.lora.request import LoRARequest

TOL = 1e-5


def _req(adapters, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, adapters[name][0])


def _peft_multi(toy_base, adapters, weights: dict[str, float]):
    """Independent oracle: peft model with several adapters active at once, each scaled by set_scale."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    names = list(weights)
    model = PeftModel.from_pretrained(copy.deepcopy(toy_base), adapters[names[0]][0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name][0], adapter_name=name)
    model.base_model.set_adapter(names)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, scale in weights.items():
                module.set_scale(name, scale)
    return model.eval()


@pytest.fixture(scope="module")
def vllm_model(toy_base):
    return make_vllm_dit(toy_base.state_dict())


@pytest.fixture(scope="module")
def manager(vllm_model):
    return DiffusionLoRAManager(vllm_model, max_loras=2, max_rank=8, max_cpu_loras=4)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def test_base_model_matches_without_adapters(toy_base, vllm_model, manager):
    x, c = inputs(batch=2)
    manager.deactivate()
    assert _max_err(vllm_model(x, c), toy_base(x, c)) <= TOL
    # every linear layer was patched, packed ones once
    assert sorted(manager.wrappers) == sorted(
        f"blocks.{i}.{n}"
        for i in range(2)
        for n in ("adaLN", "attn.to_qkv", "attn.to_out.0", "ff.w13", "ff.w2")
    )


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0])
@torch.no_grad()
def test_single_adapter_matches_peft(toy_base, adapters, vllm_model, manager, scale):
    x, c = inputs(batch=2)
    oracle = _peft_multi(toy_base, adapters, {"a": scale})
    manager.set_active_adapters([_req(adapters, "a", 1)], [scale])
    ours = vllm_model(x, c)
    manager.deactivate()
    err = _max_err(ours, oracle(x, c))
    print(f"single adapter scale={scale}: max abs err {err:.3g}")
    assert err <= TOL
    assert _max_err(ours, toy_base(x, c)) > 1e-2  # the adapter really changes the output


@torch.no_grad()
def test_two_composed_adapters_match_peft(toy_base, adapters, vllm_model, manager):
    x, c = inputs(batch=2)
    oracle = _peft_multi(toy_base, adapters, {"a": 0.8, "b": 0.6})
    manager.set_active_adapters([[_req(adapters, "a", 1), _req(adapters, "b", 2)]] * 2, [[0.8, 0.6]] * 2)
    ours = vllm_model(x, c)
    manager.deactivate()
    err = _max_err(ours, oracle(x, c))
    print(f"two adapters [0.8, 0.6]: max abs err {err:.3g}")
    assert err <= TOL
    only_a = _peft_multi(toy_base, adapters, {"a": 0.8})(x, c)
    assert _max_err(ours, only_a) > 1e-2


@torch.no_grad()
def test_qv_only_adapter_leaves_k_slice_zero(toy_base, adapters, vllm_model, manager):
    x, c = inputs(batch=1)
    manager.set_active_adapters([_req(adapters, "qv", 3)], [1.0])
    ours = vllm_model(x, c)
    wrapper = manager.wrappers["blocks.0.attn.to_qkv"]
    slot = manager.slot_assignment()[3]
    q_sl, k_sl, v_sl = wrapper.geometry.slices
    assert (q_sl.local_size, k_sl.local_size, v_sl.local_size) == (32, KV_HEADS * 8, KV_HEADS * 8)
    held = wrapper.slot_weights(slot)
    assert wrapper.slot_ranks(slot) == (4, 0, 4)
    # one stacked shrink for q and v (rank 4 each); the k columns of the output are never written
    assert tuple(held.a.shape) == (8, DIM)
    assert [(offset, size) for _, _, offset, size in held.parts] == [
        (q_sl.local_offset, q_sl.local_size),
        (v_sl.local_offset, v_sl.local_size),
    ]
    assert all(torch.count_nonzero(bt) > 0 for bt in held.bt)
    # untargeted layers hold nothing for this slot
    assert manager.wrappers["blocks.0.ff.w13"].slot_ranks(slot) is None
    manager.deactivate()
    err = _max_err(ours, _peft_multi(toy_base, adapters, {"qv": 1.0})(x, c))
    print(f"q+v only: max abs err {err:.3g}")
    assert err <= TOL


@pytest.mark.parametrize("name", ["rs", "pattern"])
@torch.no_grad()
def test_rslora_and_rank_alpha_patterns_match_peft(toy_base, adapters, vllm_model, manager, name):
    x, c = inputs(batch=2)
    manager.set_active_adapters([_req(adapters, name, 4)], [1.5])
    ours = vllm_model(x, c)
    slot = manager.slot_assignment()[4]
    qkv_ranks = manager.wrappers["blocks.0.attn.to_qkv"].slot_ranks(slot)
    w2_ranks = manager.wrappers["blocks.1.ff.w2"].slot_ranks(slot)
    manager.deactivate()
    manager.remove_lora(4)
    err = _max_err(ours, _peft_multi(toy_base, adapters, {name: 1.5})(x, c))
    print(f"{name}: max abs err {err:.3g}")
    assert err <= TOL
    if name == "pattern":  # rank_pattern {"to_q": 2, "ff.w2": 6} reached the buffers
        assert qkv_ranks == (2, 4, 4) and w2_ranks == (6,)
    else:
        assert qkv_ranks == (4, 4, 4)


@torch.no_grad()
def test_plain_nn_linear_path_matches_peft(toy_base, adapters):
    """The diffusers fallback: unpacked nn.Linear layers, no stacked mapping."""
    model = copy.deepcopy(toy_base)
    mgr = DiffusionLoRAManager(model, max_loras=2, max_rank=8)
    assert len(mgr.wrappers) == 16
    x, c = inputs(batch=3)
    mgr.set_active_adapters([_req(adapters, "a", 1), _req(adapters, "b", 2)], [0.8, -0.6])
    ours = model(x, c)
    err = _max_err(ours, _peft_multi(toy_base, adapters, {"a": 0.8, "b": -0.6})(x, c))
    print(f"nn.Linear path: max abs err {err:.3g}")
    assert err <= TOL
    mgr.deactivate()
    assert torch.equal(model(x, c), toy_base(x, c))


@torch.no_grad()
def test_outputs_stay_in_a_meaningful_range(toy_base, adapters, vllm_model, manager):
    """Guards the tolerance above: outputs must be O(1..100), so 1e-5 absolute is a tight bound."""
    x, c = inputs(batch=2)
    for name in ("a", "b", "rs", "pattern"):
        out = _peft_multi(toy_base, adapters, {name: 2.0})(x, c)
        assert 0.5 < out.abs().max().item() < 100.0


def test_patching_keeps_state_dict_names(toy_base):
    model = copy.deepcopy(toy_base)
    keys = list(model.state_dict())
    DiffusionLoRAManager(model, max_loras=1, max_rank=4)
    assert list(model.state_dict()) == keys
    model.load_state_dict(toy_base.state_dict())  # strict round trip
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), toy_base.state_dict().values(), strict=True)
    )
