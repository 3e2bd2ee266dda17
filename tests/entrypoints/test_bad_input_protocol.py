"""Request bodies whose values vLLM refuses become 400s naming the problem, never 500s."""

from __future__ import annotations

import pytest

from vllm_omni.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from vllm_omni.errors import OpenAIError


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_n_above_one_with_greedy_sampling_is_a_400(model):
    body = {"n": 2, "temperature": 0.0, "max_tokens": 3}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]}
        if model is ChatCompletionRequest
        else {"prompt": "hi"}
    )
    req = parse_body(model, body)
    with pytest.raises(OpenAIError) as info:
        req.sampling_params()
    assert info.value.status == 400 and "n must be 1 when using greedy sampling" in info.value.message


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_seed_outside_int64_is_a_400(model):
    """An out-of-range seed used to reach the engine, whose step failed and took the stage down."""
    body = {"seed": 2**80}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]}
        if model is ChatCompletionRequest
        else {"prompt": "hi"}
    )
    with pytest.raises(OpenAIError, match="seed") as info:
        parse_body(model, body)
    assert info.value.status == 400
