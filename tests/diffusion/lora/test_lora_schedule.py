"""Scale schedules on the in-tree Z-Image denoiser: per step (forward context), per block (peft's
per-module scale on diffusers' model as the oracle), composed and in mixed batches."""

from __future__ import annotations

import copy

import pytest
import torch
from test_lora_z_image import _inputs, z_models  # noqa: F401  (module fixture)

from vllm_omni.diffusion.forward_context import denoising_step, set_forward_context
from vllm_omni.diffusion.lora import DiffusionLoRAManager
from vllm_omni.errors import InvalidAdapterError, InvalidRequestError
from vllm_omni.lora.request import LoRARequest
from vllm_omni.lora.schedule import LoRAScaleSchedule

STEPS = 3
BLOCKS = {"layers.1": 0.0, "noise_refiner.*": 2.0, "*.feed_forward": -0.5, "0": 1.5}


def _block_multiplier(name: str) -> float:
    """``BLOCKS`` written out by hand for diffusers' module names (the last matching entry wins)."""
    if name.startswith("layers.0."):
        return 1.5
    if ".feed_forward." in name:
        return -0.5
    if name.startswith("noise_refiner."):
        return 2.0
    return 0.0 if name.startswith("layers.1.") else 1.0


@pytest.fixture(scope="module")
def setup(z_models):  # noqa: F811
    reference, ours, peft_models = z_models
    manager = DiffusionLoRAManager(ours, max_loras=2, max_rank=8)
    ra = LoRARequest("a", 1, peft_models["a"][0])
    rb = LoRARequest("b", 2, peft_models["b"][0])
    yield ours, manager, ra, rb, peft_models
    manager.deactivate()


def _run(model, x, t, cap, step=None):
    with set_forward_context():
        if step is None:
            return torch.stack(model(x, t, cap))
        with denoising_step(step, STEPS):
            return torch.stack(model(x, t, cap))


@torch.no_grad()
def test_per_step_scales_equal_a_constant_scale_at_each_step(setup):
    ours, manager, ra, rb, _ = setup
    x, t, cap = _inputs()
    values = [1.0, -0.5, 0.0]
    ranges = [{"start": 0.0, "end": 0.5, "scale": 2.0}, {"start": 0.5, "end": 1.0, "scale": 0.25}]
    for schedule, expected in ((values, values), (ranges, [2.0, 2.0, 0.25])):  # fractions 0, 1/3, 2/3
        with manager.activate([ra], [LoRAScaleSchedule.parse(schedule)]):
            got = [_run(ours, x, t, cap, i) for i in range(STEPS)]
            writes = manager.slot_writes
            again = _run(ours, x, t, cap, 0)  # back to step 0: scales only, no slot write
            assert manager.slot_writes == writes and torch.equal(again, got[0])
        for i, scale in enumerate(expected):
            with manager.activate([ra], [scale]):
                assert torch.equal(got[i], _run(ours, x, t, cap)), (schedule, i)
    # two composed adapters (the stacked path): the schedule scales A x per step, the weights stay
    with manager.activate([ra, rb], [LoRAScaleSchedule.parse(values), 0.5]):
        got = [_run(ours, x, t, cap, i) for i in range(STEPS)]
    for i, scale in enumerate(values):
        with manager.activate([ra, rb], [scale, 0.5]):
            assert (got[i] - _run(ours, x, t, cap)).abs().max().item() <= 1e-6, i
    # a per-step schedule outside a reported step is refused, not applied at some scale
    refused = pytest.raises(InvalidRequestError, match="reports its denoising step")
    with manager.activate([ra], [LoRAScaleSchedule.parse(values)]), refused:
        _run(ours, x, t, cap)


@torch.no_grad()
def test_block_multipliers_match_peft_per_module_scale(setup):
    from peft.tuners.lora import LoraLayer

    ours, manager, ra, _, peft_models = setup
    x, t, cap = _inputs()
    schedule = LoRAScaleSchedule.parse({"steps": [0.8, 0.4, 1.0], "blocks": BLOCKS})
    with manager.activate([ra], [schedule]):
        got = _run(ours, x, t, cap, 1)
    oracle = copy.deepcopy(peft_models["a"][1])
    touched = 0
    for name, module in oracle.base_model.model.named_modules():
        if isinstance(module, LoraLayer):
            module.set_scale("default", 0.4 * _block_multiplier(name))
            touched += _block_multiplier(name) != 1.0
    want = torch.stack(oracle(x, t, cap, return_dict=False)[0])
    err = (got - want).abs().max().item()
    print(f"block multipliers vs peft per-module scale: max abs err {err:.2e} ({touched} modules rescaled)")
    assert err <= 1e-5 and touched > 10
    with manager.activate([ra], [0.4]):
        assert (got - _run(ours, x, t, cap)).abs().max().item() > 1e-3  # the multipliers really act


@torch.no_grad()
def test_mixed_batch_of_schedules_equals_each_request_alone(setup):
    ours, manager, ra, rb, _ = setup
    x, t, cap = _inputs()
    first = [LoRAScaleSchedule.parse({"steps": [1.0, -0.5, 2.0], "blocks": BLOCKS}), 0.5]
    second = [
        LoRAScaleSchedule.parse(
            [{"start": 0.0, "end": 0.5, "scale": 0.0}, {"start": 0.5, "end": 1, "scale": 1}]
        )
    ]
    with manager.activate([[ra, rb], [rb]], [first, second]):
        mixed = [_run(ours, x, t, cap, i) for i in range(STEPS)]
    for n, (reqs, scales) in enumerate((([ra, rb], first), ([rb], second))):
        with manager.activate(reqs, scales):
            for i in range(STEPS):
                alone = _run(ours, [x[n]], t[n : n + 1], [cap[n]], i)[0]
                err = (mixed[i][n] - alone).abs().max().item()
                assert err <= 1e-6, (n, i, err)
    # step 0 of the second request has scale 0: bit-for-bit the base output of the same batch
    assert torch.equal(mixed[0][1], _run(ours, x, t, cap)[1])


def test_unknown_block_pattern_is_refused_before_any_change(setup):
    _, manager, ra, _, _ = setup
    writes = manager.slot_writes
    with pytest.raises(
        InvalidAdapterError, match="blocks pattern 'single_transformer_blocks.*' matches no LoRA"
    ):
        manager.set_active_adapters(
            [ra], [LoRAScaleSchedule.parse({"blocks": {"single_transformer_blocks.*": 0.5}})]
        )
    with pytest.raises(InvalidAdapterError, match="blocks pattern 9 matches no LoRA layer"):
        manager.set_active_adapters([ra], [LoRAScaleSchedule.parse({"blocks": {"9": 0.5}})])
    assert manager.slot_writes == writes and manager.active_lora_ids == ()
