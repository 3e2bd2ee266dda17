"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's routes and shapes) with the entry LLM stage's tokenizer.

- ``/tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "continue_final_message": false, "add_special_tokens": false}``
  (rendered by the chat template as chat completions render it); ``return_token_strs`` adds
  each token's string. Answer: ``{"count", "max_model_len", "tokens", "token_strs"}``.
- ``/detokenize``: ``{"tokens": [int, ...]}`` -> ``{"prompt": str}``.

Both take an optional ``model`` (404 when it names neither the model nor a loaded adapter) and
answer 400 on a pipeline whose entry stage is not an LLM (no tokenizer).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_omni.entrypoints.openai.errors import bad_request
from vllm_omni.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_body,
)
from vllm_omni.entrypoints.openai.routes.chat import TOKENIZE_POOL, chat_prompt
from vllm_omni.entrypoints.openai.routes.common import read_json, resolve_adapters
from vllm_omni.entrypoints.openai.state import ServerState, get_state

router = APIRouter()


def _require_tokenizer(state: ServerState, route: str) -> None:
    if state.tokenizer is None:
        raise bad_request(
            f"{route}: pipeline {state.info.pipeline!r} has no LLM entry stage, hence no tokenizer"
        )


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    """Token ids of a prompt or a conversation (see the module docstring)."""
    state = get_state(request)
    data = await read_json(request)
    chat = isinstance(data, dict) and "messages" in data
    req = parse_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, data)
    _require_tokenizer(state, "/tokenize")
    resolve_adapters(state, req.model, None)  # 404 for an unknown model
    tok = state.tokenizer
    context = state.info.max_model_len or 0
    if context and len(getattr(req, "prompt", "")) > 2 * context * state.max_token_chars:
        raise bad_request(f"the prompt is longer than this model's context of {context} tokens", "prompt")

    def run() -> list[int]:
        if isinstance(req, TokenizeChatRequest):
            if req.continue_final_message and req.add_generation_prompt:
                raise bad_request(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    "continue_final_message",
                )
            chat_req = ChatCompletionRequest.model_validate(
                {"messages": req.messages, "chat_template_kwargs": req.chat_template_kwargs}
            )
            ids = chat_prompt(state, chat_req, req.add_generation_prompt, req.continue_final_message)
            ids = ids["prompt_token_ids"]
            if req.add_special_tokens:
                ids = tok.build_inputs_with_special_tokens(ids)
            return list(ids)
        return list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))

    tokens = await asyncio.get_running_loop().run_in_executor(TOKENIZE_POOL, run)
    body = {"count": len(tokens), "max_model_len": context, "tokens": tokens, "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = tok.convert_ids_to_tokens(tokens)
    return JSONResponse(body)


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    """The text of token ids: ``{"prompt": str}`` (400 naming ``tokens`` for an id out of the vocabulary)."""
    state = get_state(request)
    req = parse_body(DetokenizeRequest, await read_json(request))
    _require_tokenizer(state, "/detokenize")
    resolve_adapters(state, req.model, None)
    tok = state.tokenizer
    size = len(tok)
    bad = next((t for t in req.tokens if not 0 <= t < size), None)
    if bad is not None:
        raise bad_request(f"tokens: {bad} is not a token id of this model (0 to {size - 1})", "tokens")
    text = await asyncio.get_running_loop().run_in_executor(TOKENIZE_POOL, tok.decode, req.tokens)
    return JSONResponse({"prompt": text})
