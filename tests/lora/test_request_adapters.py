"""One request-adapter type and its one validation (lora/request.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import (
    LoRARequest,
    RequestAdapter,
    gather_request_adapters,
    to_request_adapters,
    validate_request_adapters,
)

A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")


def test_lists_become_frozen_request_adapters():
    adapters = to_request_adapters([A, B], [0.5, 2])
    assert adapters == (RequestAdapter(A, 0.5), RequestAdapter(B, 2.0))
    assert type(adapters[1].scale) is float
    assert to_request_adapters([A, B]) == (RequestAdapter(A), RequestAdapter(B))  # None: stage default
    with pytest.raises(dataclasses.FrozenInstanceError):
        adapters[0].scale = 3.0


@pytest.mark.parametrize(
    "adapters, max_loras, match",
    [
        ([RequestAdapter(A), RequestAdapter(B)], 1, "exceed max_loras=1"),
        (
            [RequestAdapter(A), RequestAdapter(LoRARequest("a2", 1, "/x"))],
            None,
            r"lora_requests\[1\].*appears twice",
        ),
        ([RequestAdapter(A), RequestAdapter(B, math.nan)], None, r"lora_scales\[1\] must be a finite number"),
        ([RequestAdapter(A, True)], None, r"lora_scales\[0\] must be a finite number"),
        ([RequestAdapter("a")], None, r"lora_requests\[0\] must be a LoRARequest"),
        ([A], None, r"lora_requests\[0\] must be a RequestAdapter"),
    ],
)
def test_one_validation_names_the_field(adapters, max_loras, match):
    with pytest.raises(InvalidRequestError, match=match):
        validate_request_adapters(adapters, max_loras)


def test_list_shapes_and_places():
    with pytest.raises(InvalidRequestError, match="one entry per lora_requests entry"):
        to_request_adapters([A], [1.0, 2.0])
    with pytest.raises(InvalidRequestError, match="in one place"):
        gather_request_adapters(([A], []), lora_request=B)
    with pytest.raises(InvalidRequestError, match="lora_scale needs lora_request"):
        gather_request_adapters(lora_scale=0.5)
    with pytest.raises(InvalidRequestError, match="lora_scales needs lora_requests"):
        gather_request_adapters(lora_scales=[0.5])
    assert gather_request_adapters(lora_request=A, lora_scale=0.5) == (RequestAdapter(A, 0.5),)
    assert gather_request_adapters(([A, B], [1.0, 0.0])) == (RequestAdapter(A, 1.0), RequestAdapter(B, 0.0))
    assert gather_request_adapters() == ()


def test_sampling_params_carry_the_same_adapters():
    params = OmniDiffusionSamplingParams(lora_requests=[A, B], lora_scales=[1.0, -1.0])
    assert params.adapters == (RequestAdapter(A, 1.0), RequestAdapter(B, -1.0))
    with pytest.raises(ValueError, match="appears twice"):  # InvalidRequestError is a ValueError
        OmniDiffusionSamplingParams(lora_requests=[A, A])
