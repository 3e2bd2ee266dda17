"""Exceptions from ``AsyncOmni`` become HTTP errors by their type, in one place."""

from __future__ import annotations

import pytest
from vllm.exceptions import VLLMClientError

from vllm_omni.entrypoints.openai.errors import engine_error_to_openai, engine_errors
from vllm_omni.errors import (
    ConfigError,
    InvalidAdapterError,
    InvalidRequestError,
    LoRACacheError,
    LoRAFormatError,
    LoRANotEnabledError,
    OpenAIError,
    StageDeadError,
    StageEngineError,
)


@pytest.mark.parametrize(
    "exc, status, param",
    [
        (InvalidAdapterError("x"), 400, "lora"),
        (LoRAFormatError("x"), 400, "lora"),
        (LoRANotEnabledError("x"), 400, "lora"),
        (InvalidRequestError("an adapter is mentioned here"), 400, None),  # type, not text, decides
        (ConfigError("x"), 400, None),
        (VLLMClientError("prompt too long"), 400, None),
        (ValueError("bad adapter"), 400, None),
        (StageEngineError("stage 0 failed"), 500, None),
        (StageDeadError("stage 0 is gone"), 500, None),
    ],
)
def test_mapping_by_type(exc, status, param):
    err = engine_error_to_openai(exc)
    assert (err.status, err.param, err.message) == (status, param, str(exc))


def test_params_of_the_admin_routes_and_passthrough():
    assert engine_error_to_openai(InvalidAdapterError("x"), "lora_path", "lora_path").param == "lora_path"
    assert engine_error_to_openai(ValueError("x"), "lora_name", "lora_name").param == "lora_name"
    own = OpenAIError("x", 404, "model")
    assert engine_error_to_openai(own) is own
    assert engine_error_to_openai(LoRACacheError("full")) is None  # unexpected here: the app's 500


def test_context_manager_reraises_mapped_and_leaves_others():
    with pytest.raises(OpenAIError) as info, engine_errors("lora"):
        raise LoRAFormatError("bad file")
    assert info.value.status == 400 and isinstance(info.value.__cause__, LoRAFormatError)
    with pytest.raises(RuntimeError), engine_errors("lora"):
        raise RuntimeError("boom")
