"""Mixed batches: per-sample adapter sets and scales, exact zero / negative scales, packed fused-name adapters."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from lora_toy_models import DIM, HEAD_DIM, HEADS, KV_HEADS, inputs, make_vllm_dit

from vllm_omni.diffusion.lora import (
    DiffusionLoRAManager,
    LoRAAdapterWeights,
    LoRAModuleWeights,
    lora_rows_per_sample,
)
from vllm_omni.lora.request import LoRARequest


@pytest.fixture(scope="module")
def setup(toy_base, adapters):
    model = make_vllm_dit(toy_base.state_dict())
    manager = DiffusionLoRAManager(model, max_loras=3, max_rank=8, max_cpu_loras=4)
    reqs = {name: LoRARequest(name, i + 1, adapters[name][0]) for i, name in enumerate(["a", "b", "qv"])}
    return model, manager, reqs


@torch.no_grad()
def test_batch_of_four_adapter_sets_equals_each_alone(setup):
    model, manager, r = setup
    x, c = inputs(batch=4, seed=7)
    sets = [
        ([r["a"]], [1.0]),
        ([r["b"], r["qv"]], [0.7, -1.3]),
        ([r["a"], r["b"]], [0.5, 2.0]),
        ([], []),
    ]
    manager.set_active_adapters([s[0] for s in sets], [s[1] for s in sets])
    assert manager.scale_matrix.shape == (4, 3)
    batched = model(x, c)
    manager.deactivate()
    base_batched = model(x, c)
    worst = 0.0
    for n, (reqs, scales) in enumerate(sets):
        manager.set_active_adapters([reqs], [scales])
        alone = model(x[n : n + 1], c[n : n + 1])
        manager.deactivate()
        worst = max(worst, (batched[n] - alone[0]).abs().max().item())
    print(f"batch vs alone: max abs err {worst:.3g}")
    assert worst <= 1e-5
    # the adapter-free sample is bit-identical to the base output of the same batch
    assert torch.equal(batched[3], base_batched[3])
    assert not torch.allclose(batched[0], base_batched[0], atol=1e-3)


@torch.no_grad()
def test_zero_scale_is_bit_identical_to_absent(setup):
    model, manager, r = setup
    x, c = inputs(batch=2, seed=8)
    manager.set_active_adapters([[r["a"], r["b"]], [r["b"]]], [[1.0, 0.0], [0.9]])
    with_zero = model(x, c)
    manager.set_active_adapters([[r["a"]], [r["b"]]], [[1.0], [0.9]])
    absent = model(x, c)
    assert torch.equal(with_zero, absent)
    # all-zero request == base, bit for bit; the slot stays resident
    manager.set_active_adapters([r["a"], r["b"]], [0.0, 0.0])
    assert 1 in manager.slot_assignment() and 2 in manager.slot_assignment()
    zero = model(x, c)
    manager.deactivate()
    assert torch.equal(zero, model(x, c))


@torch.no_grad()
def test_negative_scale_negates_delta_exactly():
    """With a zero base layer the output *is* the delta, so the sign flip must be exact."""
    linear = nn.Linear(DIM, 24, bias=False)
    nn.init.zeros_(linear.weight)
    holder = nn.Sequential(linear)
    gen = torch.Generator().manual_seed(3)
    adapter = LoRAAdapterWeights(
        {"0": LoRAModuleWeights(torch.randn(4, DIM, generator=gen), torch.randn(24, 4, generator=gen), 0.75)}
    )
    manager = DiffusionLoRAManager(holder, max_loras=1, max_rank=4, adapter_loader=lambda path: adapter)
    req = LoRARequest("neg", 1, "/virtual/neg")
    x = torch.randn(3, 7, DIM, generator=gen)
    manager.set_active_adapters([req], [0.6])
    plus = holder(x)
    manager.set_active_adapters([req], [-0.6])
    minus = holder(x)
    manager.set_active_adapters([[req], [req], [req]], [[0.6], [-0.6], [0.0]])
    mixed = holder(x)
    assert torch.equal(minus, -plus)
    assert torch.equal(mixed[0], plus[0]) and torch.equal(mixed[1], minus[1])
    assert torch.count_nonzero(mixed[2]) == 0
    expected = 0.6 * (x @ adapter.modules["0"].lora_a.T) @ (0.75 * adapter.modules["0"].lora_b).T
    assert (plus - expected).abs().max().item() <= 1e-5


@torch.no_grad()
def test_adapter_on_fused_layer_name_applies_whole(toy_base):
    """An adapter trained on ``to_qkv`` / ``w13`` themselves: one A, B spanning all slices."""
    model = make_vllm_dit(toy_base.state_dict(), n_blocks=2)
    gen = torch.Generator().manual_seed(5)
    qkv_out = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    mods = {
        "transformer.blocks.0.attn.to_qkv": LoRAModuleWeights(
            torch.randn(4, DIM, generator=gen) * 0.1, torch.randn(qkv_out, 4, generator=gen) * 0.1, 0.5
        ),
        "diffusion_model.blocks.1.ff.w13": LoRAModuleWeights(
            torch.randn(8, DIM, generator=gen) * 0.1, torch.randn(96, 8, generator=gen) * 0.1, 2.0
        ),
    }
    adapter = LoRAAdapterWeights(mods)
    manager = DiffusionLoRAManager(model, max_loras=1, max_rank=8, adapter_loader=lambda path: adapter)
    manager.set_active_adapters([LoRARequest("fused", 1, "/virtual/fused")], [1.25])
    wrapper = manager.wrappers["blocks.0.attn.to_qkv"]
    held = wrapper.slot_weights(0)
    assert wrapper.slot_ranks(0) == (4, 4, 4) and held.shared_a and held.a.shape[0] == 4
    h = torch.randn(2, 5, DIM, generator=gen)
    ours = wrapper(h)[0]
    manager.deactivate()
    base = wrapper(h)[0]
    m = mods["transformer.blocks.0.attn.to_qkv"]
    expected = base + 1.25 * 0.5 * (h @ m.lora_a.T) @ m.lora_b.T
    assert (ours - expected).abs().max().item() <= 1e-5
    w13 = manager.wrappers["blocks.1.ff.w13"]
    manager.set_active_adapters([LoRARequest("fused", 1, "/virtual/fused")], [1.0])
    m13 = mods["diffusion_model.blocks.1.ff.w13"]
    expected = w13.base_layer(h)[0] + 2.0 * (h @ m13.lora_a.T) @ m13.lora_b.T
    assert (w13(h)[0] - expected).abs().max().item() <= 1e-5


@torch.no_grad()
def test_mixed_batch_rejects_layer_inputs_without_sample_dim(setup):
    model, manager, r = setup
    manager.set_active_adapters([[r["a"]], [r["b"]]], [[1.0], [1.0]])
    wrapper = manager.wrappers["blocks.0.adaLN"]
    with pytest.raises(RuntimeError, match="leading dimension 6"):
        wrapper(torch.randn(6, DIM))
    manager.deactivate()


@torch.no_grad()
def test_switching_between_slotted_sets_does_not_reupload(setup):
    model, manager, r = setup
    manager.set_active_adapters([[r["a"]], [r["b"]]], [[1.0], [1.0]])
    writes = manager.slot_writes
    slots = manager.slot_assignment()
    for sets, scales in [
        ([[r["b"]], [r["a"]]], [[0.3], [0.2]]),
        ([r["a"], r["b"]], [1.0, 1.0]),
        ([[r["a"]], [r["b"]]], [[1.0], [1.0]]),
    ]:
        manager.set_active_adapters(sets, scales)
    assert manager.slot_writes == writes
    assert {k: v for k, v in manager.slot_assignment().items() if k in (1, 2)} == {
        k: v for k, v in slots.items() if k in (1, 2)
    }
    manager.deactivate()


@torch.no_grad()
def test_ragged_concatenated_rows_with_declared_layout():
    """Embedders see ``cat(samples)`` rows; lora_rows_per_sample maps them back to samples."""
    gen = torch.Generator().manual_seed(9)
    holder = nn.Sequential(nn.Linear(DIM, 16))
    mods = {
        name: LoRAAdapterWeights(
            {
                "0": LoRAModuleWeights(
                    torch.randn(4, DIM, generator=gen), torch.randn(16, 4, generator=gen), 0.5
                )
            }
        )
        for name in ("p", "q")
    }
    manager = DiffusionLoRAManager(
        holder, max_loras=2, max_rank=4, adapter_loader=lambda path: mods[path[-1]]
    )
    p, q = LoRARequest("p", 1, "/v/p"), LoRARequest("q", 2, "/v/q")
    sets = [([p], [1.0]), ([], []), ([p, q], [0.5, -2.0]), ([q], [0.25])]
    lengths = [3, 5, 2, 4]
    x = torch.randn(sum(lengths), DIM, generator=gen)
    manager.set_active_adapters([s[0] for s in sets], [s[1] for s in sets])
    with pytest.raises(RuntimeError, match="lora_rows_per_sample"):
        holder(x)
    with lora_rows_per_sample(lengths):
        ragged = holder(x)
    start, worst = 0, 0.0
    for (reqs, scales), n in zip(sets, lengths, strict=True):
        manager.set_active_adapters([reqs], [scales])
        alone = holder(x[start : start + n])
        worst = max(worst, (ragged[start : start + n] - alone).abs().max().item())
        start += n
    manager.deactivate()
    assert worst <= 1e-5
    assert torch.equal(ragged[3:8], holder(x)[3:8])  # the adapter-free sample is untouched


@torch.no_grad()
def test_composed_adapters_stack_into_one_shrink_and_match_the_sum(toy_base):
    """K adapters with one scale each for every row run as one stacked shrink / expand per layer.

    The three adapters overlap differently on the packed ``to_qkv``: one targets the whole layer
    (shared ``A``), one ``to_q`` + ``to_v``, one only ``to_k``. The stacked result must equal
    ``base + sum_j lambda_j s_j B_j A_j x`` slice by slice, and a different activation must rebuild it.
    """
    model = make_vllm_dit(toy_base.state_dict(), n_blocks=2)
    gen = torch.Generator().manual_seed(11)
    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv_out = q_out + 2 * kv_out

    def mod(rank, out, scaling):
        return LoRAModuleWeights(
            torch.randn(rank, DIM, generator=gen) * 0.1, torch.randn(out, rank, generator=gen) * 0.1, scaling
        )

    adapters = {
        "/virtual/whole": LoRAAdapterWeights({"transformer.blocks.0.attn.to_qkv": mod(4, qkv_out, 0.5)}),
        "/virtual/qv": LoRAAdapterWeights(
            {"blocks.0.attn.to_q": mod(2, q_out, 1.0), "blocks.0.attn.to_v": mod(3, kv_out, 2.0)}
        ),
        "/virtual/k": LoRAAdapterWeights({"blocks.0.attn.to_k": mod(5, kv_out, 0.25)}),
    }
    manager = DiffusionLoRAManager(model, max_loras=3, max_rank=8, adapter_loader=adapters.__getitem__)
    reqs = [LoRARequest(p.rsplit("/", 1)[1], i + 1, p) for i, p in enumerate(adapters)]
    scales = [1.25, -0.7, 0.4]
    wrapper = manager.wrappers["blocks.0.attn.to_qkv"]
    h = torch.randn(2, 5, DIM, generator=gen)
    base = wrapper(h)[0]

    def delta(m, lam):
        return lam * m.scaling * (h @ m.lora_a.T) @ m.lora_b.T

    whole = adapters["/virtual/whole"].modules["transformer.blocks.0.attn.to_qkv"]
    qv = adapters["/virtual/qv"].modules
    k = adapters["/virtual/k"].modules["blocks.0.attn.to_k"]
    expected = base + delta(whole, scales[0])
    expected[..., :q_out] += delta(qv["blocks.0.attn.to_q"], scales[1])
    expected[..., q_out : q_out + kv_out] += delta(k, scales[2])
    expected[..., q_out + kv_out :] += delta(qv["blocks.0.attn.to_v"], scales[1])

    manager.set_active_adapters(reqs, scales)
    ours = wrapper(h)[0]
    stacked = manager._state.stacked[id(wrapper)]
    # one shrink over 4 + 2 + 3 + 5 A rows; one expand per distinct output range (whole, q, v, k)
    assert stacked.a.shape == (14, DIM)
    assert sorted((offset, size) for _, _, offset, size in stacked.parts) == [
        (0, q_out),
        (0, qkv_out),
        (q_out, kv_out),
        (q_out + kv_out, kv_out),
    ]
    assert (ours - expected).abs().max().item() <= 1e-5

    # the per-slot path (a mixed batch of the same rows) gives the same result
    manager.set_active_adapters([reqs, reqs], [scales, [scales[0], scales[1], 0.1]])
    assert not manager._state.uniform
    per_slot = wrapper(h)[0]
    assert (per_slot[0] - expected[0]).abs().max().item() <= 1e-5
    assert (per_slot[1] - expected[1]).abs().max().item() > 1e-4  # its k scale differs

    # another activation rebuilds the stack; dropping to one adapter uses the plain path
    manager.set_active_adapters(reqs[:2], scales[:2])
    two = wrapper(h)[0]
    assert (two - (expected - _k_part(h, k, scales[2], q_out, kv_out))).abs().max().item() <= 1e-5
    manager.set_active_adapters(reqs[:1], scales[:1])
    assert (wrapper(h)[0] - (base + delta(whole, scales[0]))).abs().max().item() <= 1e-5
    assert manager._state.stacked == {}
    manager.deactivate()
    assert torch.equal(wrapper(h)[0], base)


def _k_part(h, k, lam, q_out, kv_out):
    out = torch.zeros(*h.shape[:-1], q_out + 2 * kv_out)
    out[..., q_out : q_out + kv_out] = lam * k.scaling * (h @ k.lora_a.T) @ k.lora_b.T
    return out
