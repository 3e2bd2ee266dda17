"""LoRAScaleSchedule: the public forms, the step / block conventions and the refusals."""

from __future__ import annotations

import math

import pytest

from vllm_omni.errors import InvalidAdapterError, InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest, RequestAdapter, validate_request_adapters
from vllm_omni.lora.schedule import MAX_ADAPTER_SCALE, LoRAScaleSchedule, ScaleRange, coerce_scale

A = LoRARequest("style", 1, "/tmp/a")
RANGES = [{"start": 0.0, "end": 0.4, "scale": 1.0}, {"start": 0.4, "end": 1.0, "scale": 0.3}]
LAYERS = [
    "layers.0.attention.to_qkv",
    "layers.0.feed_forward.w13",
    "layers.1.attention.to_qkv",
    "layers.10.attention.to_qkv",
    "noise_refiner.0.attention.to_qkv",
    "transformer_2.layers.0.attention.to_qkv",
]


def test_public_forms_parse_to_one_hashable_type():
    assert coerce_scale(None, "s") is None
    assert coerce_scale(2, "s") == 2.0 and type(coerce_scale(2, "s")) is float
    per_step = coerce_scale([1, 0.5, 0], "s")
    assert per_step == LoRAScaleSchedule((1.0, 0.5, 0.0))
    ranges = coerce_scale(RANGES, "s")
    assert ranges.steps == (ScaleRange(0.0, 0.4, 1.0), ScaleRange(0.4, 1.0, 0.3))
    full = coerce_scale({"steps": RANGES, "blocks": {"layers.1": 0.5, "3": 2.0}}, "s")
    assert full.blocks == (("layers.1", 0.5), (3, 2.0))  # digit strings (JSON keys) are block indices
    assert coerce_scale(full, "s") == full and hash(full) == hash(coerce_scale(full, "s"))
    assert coerce_scale({"blocks": {"layers.1": 0.0}}, "s").steps is None


def test_step_fraction_convention():
    # step i of N has fraction i / N; range [start, end) holds it (diffusers' callback index i)
    s = LoRAScaleSchedule.parse(RANGES)
    assert [s.scale_at(i, 5) for i in range(5)] == [1.0, 1.0, 0.3, 0.3, 0.3]  # 0, .2 | .4, .6, .8
    assert [s.scale_at(i, 2) for i in range(2)] == [1.0, 0.3]
    per_step = LoRAScaleSchedule.parse([2.0, -1.0])
    assert [per_step.scale_at(i, 2) for i in range(2)] == [2.0, -1.0]
    assert LoRAScaleSchedule(0.7).scale_at(None, None) == 0.7
    assert LoRAScaleSchedule(None).scale_at(None, None, default=0.25) == 0.25
    with pytest.raises(InvalidRequestError, match="reports its denoising step"):
        per_step.scale_at(None, None)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([1.0, math.nan], r"s\[1\] must be a finite number"),
        ([1.0, math.inf], r"s\[1\] must be a finite number"),
        ([1.0, MAX_ADAPTER_SCALE + 1], r"s\[1\] must be a finite number in \[-100, 100\]"),
        ([True], r"s\[0\] must be a finite number"),
        ([], r"s must hold 1 to"),
        ([{"start": 0.0, "end": 0.5, "scale": 1.0}], r"must cover \[0, 1\]; they end at 0.5"),
        (
            [{"start": 0.0, "end": 0.6, "scale": 1.0}, {"start": 0.5, "end": 1.0, "scale": 0.0}],
            "overlap",
        ),
        (
            [{"start": 0.0, "end": 0.4, "scale": 1.0}, {"start": 0.5, "end": 1.0, "scale": 0.0}],
            "leave a gap",
        ),
        ([{"start": 0.5, "end": 0.5, "scale": 1.0}], r"0 <= start < end <= 1"),
        ([{"start": 0.0, "end": 1.0}], "missing \\['scale'\\]"),
        ([{"start": 0.0, "end": 1.0, "scale": 1.0, "x": 1}], "unknown \\['x'\\]"),
        ({"steps": 1.0, "blocks": {"layers.1": math.nan}}, r"s.blocks\['layers.1'\] must be a finite number"),
        ({"steps": 50.0, "blocks": {"layers.1": 3.0}}, "reaches 150, beyond the limit 100"),
        ({"steps": 1.0, "blocks": {"": 1.0}}, "must be a module-name pattern or a block index"),
        ({"steps": 1.0, "blocks": [1, 2]}, "must map patterns or block indices"),
        ({"step": 1.0}, r"unknown key\(s\) \['step'\]"),
        ({}, "s is an empty schedule"),  # was read as the default scale
        ({"blocks": {}}, "s is an empty schedule"),
        ({"steps": None, "blocks": None}, "s is an empty schedule"),
        ([], r"s must hold 1 to 1000 entries, got 0"),
        ({"steps": []}, r"s.steps must hold 1 to 1000 entries, got 0"),
        ("high", "must be a finite number"),
    ],
)
def test_refusals_name_the_field(value, match):
    with pytest.raises(InvalidRequestError, match=match):
        coerce_scale(value, "s")


def test_block_patterns_and_indices_resolve_to_layers():
    s = LoRAScaleSchedule.parse({"blocks": {"layers.*": 0.5, "1": 2.0, "*.w13": 0.0, "noise_refiner": 3.0}})
    factors = s.block_factors(LAYERS, "layers")
    assert factors == {
        "layers.0.attention.to_qkv": 0.5,
        "layers.0.feed_forward.w13": 0.0,  # the last matching entry wins
        "layers.1.attention.to_qkv": 2.0,  # block index 1 is layers.1, not layers.10
        "layers.10.attention.to_qkv": 0.5,
        "noise_refiner.0.attention.to_qkv": 3.0,
    }
    # the second denoiser is addressed by its prefix
    assert LoRAScaleSchedule.parse({"blocks": {"transformer_2.*": 0.5}}).block_factors(LAYERS, "layers") == {
        "transformer_2.layers.0.attention.to_qkv": 0.5
    }
    with pytest.raises(
        InvalidAdapterError, match=r"where: blocks pattern 'single_blocks.\*' matches no LoRA layer"
    ):
        LoRAScaleSchedule.parse({"blocks": {"single_blocks.*": 0.5}}).block_factors(LAYERS, "layers", "where")
    with pytest.raises(InvalidAdapterError, match="blocks pattern 7 matches no LoRA layer"):
        LoRAScaleSchedule.parse({"blocks": {"7": 0.5}}).block_factors(LAYERS, "layers")
    with pytest.raises(InvalidAdapterError, match="no block list"):
        LoRAScaleSchedule.parse({"blocks": {"0": 0.5}}).block_factors(LAYERS, None)


def test_request_paths_check_the_step_count_and_name_the_adapter():
    ok = OmniDiffusionSamplingParams(num_inference_steps=3, lora_requests=[A], lora_scales=[[1.0, 0.5, 0.0]])
    assert ok.adapters[0].scale == LoRAScaleSchedule((1.0, 0.5, 0.0))
    with pytest.raises(
        InvalidRequestError,
        match=r"lora_scales\[0\] has 2 per-step values but num_inference_steps is 3.*'style'",
    ):
        OmniDiffusionSamplingParams(num_inference_steps=3, lora_requests=[A], lora_scales=[[1.0, 0.5]])
    with pytest.raises(
        InvalidRequestError, match=r"lora\[0\].scale\[1\] must be a finite number.*\(LoRA 1, 'style'\)"
    ):
        validate_request_adapters([RequestAdapter(A, [1.0, math.nan])], field="lora")
    # ranges fit any step count
    OmniDiffusionSamplingParams(num_inference_steps=7, lora_requests=[A], lora_scales=[RANGES])
    # without a step count (e.g. generate(lora_scales=...)) the stage checks it later
    assert validate_request_adapters([RequestAdapter(A, [1.0, 2.0])])[0].scale.steps == (1.0, 2.0)
