"""The merged fast path (``merge=True``, issue 40): one adapter at one scale is folded into the base
weights of the vLLM toy DiT; its outputs equal the un-merged manager's on a second copy of the same
model (float32 rounding), the base weights come back bitwise when anything else runs (a forward without
adapters, another adapter, removal), and batches with mixed rows, several adapters or a schedule are
never served merged."""

from __future__ import annotations

import pytest
import torch
from lora_toy_models import inputs, make_vllm_dit

from vllm_omni.diffusion.lora import DiffusionLoRAManager
from vllm_omni.lora.request import LoRARequest
from vllm_omni.lora.schedule import LoRAScaleSchedule

TOL = 1e-5


@pytest.fixture(scope="module")
def pair(toy_base, adapters):
    """``(merged model, its manager, un-merged model, its manager, requests)`` on the same weights."""
    from vllm_omni.diffusion.models.weight_loading import finalize_linear_layers

    merged_model = make_vllm_dit(toy_base.state_dict(), process=False)
    finalize_linear_layers(merged_model, keep_base_weights=True)  # dense weights, as a stage keeps them
    plain_model = make_vllm_dit(toy_base.state_dict())
    sizes = dict(max_loras=2, max_rank=8, max_cpu_loras=4)
    merged = DiffusionLoRAManager(merged_model, merge=True, **sizes)
    plain = DiffusionLoRAManager(plain_model, **sizes)
    reqs = {name: LoRARequest(name, i + 1, adapters[name][0]) for i, name in enumerate(("a", "b", "qv"))}
    return merged_model, merged, plain_model, plain, reqs


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(model, snapshot) -> bool:
    return all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


@torch.no_grad()
def _run(model, manager, requests, scales, x, c):
    with manager.activate(requests, scales):
        return model(x, c)


@torch.no_grad()
def test_merged_equals_unmerged_and_the_base_comes_back_bitwise(pair):
    merged_model, merged, plain_model, plain, r = pair
    x, c = inputs(batch=2, seed=3)
    base_weights, base_out = _weights(merged_model), merged_model(x, c)
    for name, scale in (("a", 1.0), ("a", 1.0), ("b", -0.7), ("qv", 2.5)):
        got = _run(merged_model, merged, [r[name]], [scale], x, c)
        assert merged.merged.key == (r[name].lora_int_id, scale) and not merged.merged.in_use
        want = _run(plain_model, plain, [r[name]], [scale], x, c)
        assert (got - want).abs().max() <= TOL, name
        assert (got - base_out).abs().max() > 1e-3
        assert not _same(merged_model, base_weights)  # merged between requests (no re-merge for the same)
    assert merged.merged.merges == 3  # a once for two requests, then b, then qv
    assert torch.equal(merged_model(x, c), base_out)  # a forward without adapters restores first
    assert merged.merged.key is None and _same(merged_model, base_weights)
    # one adapter on every row of a per-sample activation is merged too; removal restores
    _run(merged_model, merged, [[r["b"]], [r["b"]]], [[0.5], [0.5]], x, c)
    assert merged.merged.key == (r["b"].lora_int_id, 0.5)
    assert merged.remove_lora(r["b"].lora_int_id) and _same(merged_model, base_weights)
    merged.add_lora(r["b"])


@torch.no_grad()
def test_mixed_batches_are_never_merged(pair):
    merged_model, merged, plain_model, plain, r = pair
    x, c = inputs(batch=2, seed=4)
    base_weights = _weights(merged_model)
    _run(merged_model, merged, [r["a"]], [1.0], x, c)  # something merged before
    cases = [
        ([[r["a"]], [r["b"]]], [[1.0], [1.0]]),  # two adapters over the rows
        ([[r["a"]], []], [[1.0], []]),  # an adapter-free row
        ([[r["a"]], [r["a"]]], [[1.0], [0.5]]),  # one adapter, two scales
        ([[r["a"], r["qv"]], [r["a"], r["qv"]]], [[1.0, 1.0], [1.0, 1.0]]),  # composed adapters
        ([r["a"]], [LoRAScaleSchedule.parse({"steps": 1.0, "blocks": {0: 0.5}})]),  # a block schedule
    ]
    for requests, scales in cases:
        with merged.activate(requests, scales):
            assert merged.merged.key is None and _same(merged_model, base_weights)
            got = merged_model(x, c)
        want = _run(plain_model, plain, requests, scales, x, c)
        assert (got - want).abs().max() <= TOL


@torch.no_grad()
def test_a_merge_failing_half_way_leaves_the_base(pair, monkeypatch):
    merged_model, merged, _, _, r = pair
    x, c = inputs(batch=1, seed=5)
    merged_model(x, c)  # whatever was merged is restored
    base_weights = _weights(merged_model)
    calls = []
    real = merged.merged._merge_layer

    def flaky(*args):
        calls.append(args[0])
        if len(calls) == 3:
            raise MemoryError("simulated")
        return real(*args)

    monkeypatch.setattr(merged.merged, "_merge_layer", flaky)
    with pytest.raises(MemoryError), merged.activate([r["a"]], [1.0]):
        pass
    assert merged.merged.key is None and _same(merged_model, base_weights)
