"""``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each handler runs in three steps: prepare (parse, resolve adapters, build the prompt and the
per-stage params), run (``AsyncOmni.generate``), render (the OpenAI body). Templating and
tokenisation run on a worker thread. ``stream=true`` on a text pipeline streams one chunk per
engine step (:mod:`.streaming`); an image chat answers its finished body as server-sent events.
A client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from vllm_omni.entrypoints.openai import audio_input, media
from vllm_omni.entrypoints.openai.audio import audio_message, audio_request_params
from vllm_omni.entrypoints.openai.errors import bad_request
from vllm_omni.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from vllm_omni.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from vllm_omni.entrypoints.openai.routes.common import (
    Adapters,
    output_images,
    read_json,
    resolve_adapters,
    run_pipeline,
    served_model,
    sse,
    stage_params,
    text_output,
    usage,
)
from vllm_omni.entrypoints.openai.routes.streaming import StreamRun, TextStream, stream_text
from vllm_omni.entrypoints.openai.state import ServerState, get_state
from vllm_omni.errors import OpenAIError

router = APIRouter()

# Chat templating and tokenisation (and reading a --chat-template file) run here, off the event
# loop; one thread, as a fast tokenizer must not be used from several threads at once.
TOKENIZE_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-tokenize")

_NO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


@dataclass
class PreparedRun:
    """One prompt ready for ``AsyncOmni.generate``: the prompt, per-stage params and adapters."""

    prompt: Any
    params: list[Any]
    adapters: Adapters
    last_stage: int | None = None  # text only from an audio pipeline: the stages after the text's do not run


# ---------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """Chat with an LLM pipeline (text reply; with ``"modalities": ["text", "audio"]`` on an audio
    pipeline, ``message.audio`` too: :mod:`..audio`) or an image pipeline (images as data URIs)."""
    state = get_state(request)
    req = parse_body(ChatCompletionRequest, await read_json(request))
    req.refuse_tools()
    text = "text" in state.info.output_kinds and state.info.is_llm
    if not text:
        refuse_text_only_fields(state, req)
    adapters = resolve_adapters(state, req.model, req.lora)
    audio = audio_request_params(state.info, req)
    if text:
        loop = asyncio.get_running_loop()
        run = await loop.run_in_executor(TOKENIZE_POOL, prepare_text_chat, state, req, adapters, audio)
    else:
        run = prepare_image_chat(state, req, adapters)
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_model(state, req.model, adapters),
    }
    if text and req.stream:
        spec = TextStream(
            head | {"object": "chat.completion.chunk"},
            req.n,
            role=state.settings.response_role,
            include_usage=req.include_usage,
            return_token_ids=req.return_token_ids,
            logprobs=req.logprob_count(),
            tokenizer=state.tokenizer,
        )
        runs = [StreamRun(run.prompt, run.params, run.adapters, run.last_stage)]
        return await stream_text(request, state, runs, spec)
    try:
        outputs = await run_pipeline(state, run.prompt, run.params, run.adapters, request, run.last_stage)
    except OpenAIError as exc:  # audio in and speech out: refused before any stage runs, naming the talker
        if exc.param == "multi_modal_data":
            exc.param = "modalities"
        raise
    if text:
        body = head | text_chat_reply(state, req, outputs)
        if audio is not None:
            message = body["choices"][0]["message"]
            message["audio"] = audio_message(outputs, message["content"])
            message["content"] = None  # as OpenAI answers: the text is the audio's transcript
    else:
        body = head | image_chat_reply(state, outputs)
    return sse(chat_chunks(body)) if req.stream else JSONResponse(body)


def prepare_text_chat(
    state: ServerState, req: ChatCompletionRequest, adapters: Adapters, audio: Any = None
) -> PreparedRun:
    """The templated conversation and its params; ``max_tokens`` defaults to the room left in the
    context; ``audio``: the audio stage's params when the request asks for audio."""
    prompt = chat_prompt(state, req)
    llm = req.model_copy(update={"max_tokens": req.max_completion_tokens or req.max_tokens})
    room = (state.info.max_model_len or 2048) - len(prompt["prompt_token_ids"])
    # audio placeholders grow when vLLM expands them: vLLM then gives the room left (max_tokens None)
    sp = llm.sampling_params(None if "multi_modal_data" in prompt else max(1, room), stream=req.stream)
    diffusion = req.diffusion_params(1, state.info.call_defaults) if state.info.has_diffusion_stage else None
    info = state.info
    # text only from an audio pipeline whose entry stage gives the text: its later stages do not run
    last = 0 if audio is None and "audio" in info.output_kinds and info.entry_final_output else None
    return PreparedRun(prompt, stage_params(state, sp, diffusion, audio), adapters, last)


def prepare_image_chat(state: ServerState, req: ChatCompletionRequest, adapters: Adapters) -> PreparedRun:
    """The last user message as an image prompt, and its params."""
    audio_input.refuse_audio(req, f"pipeline {state.info.pipeline!r} takes no audio input")
    prompt = last_user_text(req)
    dparams = req.diffusion_params(req.n, state.info.call_defaults)
    sp = req.sampling_params() if state.info.has_llm_stage else None
    return PreparedRun(prompt, stage_params(state, sp, dparams), adapters)


def text_chat_reply(state: ServerState, req: ChatCompletionRequest, outputs: list[Any]) -> dict[str, Any]:
    """``choices`` and ``usage`` (and ``prompt_token_ids`` when asked) of a text chat reply."""
    ro = text_output(outputs)
    choices = []
    top = req.logprob_count()
    for i, c in enumerate(ro.outputs):
        choice = {
            "index": i,
            "message": {"role": state.settings.response_role, "content": c.text},
            "finish_reason": c.finish_reason or "stop",
            "logprobs": None if top is None else chat_logprobs(state.tokenizer, c.token_ids, c.logprobs, top),
        }
        if req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    body: dict[str, Any] = {"choices": choices, "usage": usage(ro)}
    if req.return_token_ids:
        body["prompt_token_ids"] = list(ro.prompt_token_ids or [])
    return body


def refuse_text_only_fields(state: ServerState, req: ChatCompletionRequest) -> None:
    """Fields of a text reply asked of a pipeline that answers with images: a 400 naming the field.

    Raises:
        OpenAIError: (400) ``logprobs`` / ``top_logprobs`` or a ``response_format`` other than text.
    """
    what = f"pipeline {state.info.pipeline!r} answers with images, not text"
    if req.logprobs or req.top_logprobs:
        raise bad_request(f"logprobs: {what}", "logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request(f"response_format: {what}", "response_format")


def image_chat_reply(state: ServerState, outputs: list[Any]) -> dict[str, Any]:
    """``choices`` (one message whose content lists the images as PNG data URIs) and zero ``usage``."""
    content = [
        {"type": "image_url", "image_url": {"url": media.png_data_uri(img)}} for img in output_images(outputs)
    ]
    message = {"role": state.settings.response_role, "content": content}
    choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
    return {"choices": [choice], "usage": dict(_NO_USAGE)}


def chat_chunks(body: dict) -> list[dict]:
    """A finished chat body as ``chat.completion.chunk`` events: per choice, its content, then its finish."""
    chunks = []
    base = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for choice in body["choices"]:
        delta = {"role": choice["message"]["role"], "content": choice["message"]["content"]}
        chunks.append(base | {"choices": [{"index": choice["index"], "delta": delta, "finish_reason": None}]})
        end = {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}
        chunks.append(base | {"choices": [end]})
    return chunks


def chat_prompt(
    state: ServerState,
    req: ChatCompletionRequest,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> dict[str, Any]:
    """Token ids of the templated conversation (as vLLM renders chat: no extra special tokens);
    ``add_generation_prompt`` / ``continue_final_message``: the chat template's switches.

    Raises:
        OpenAIError: (400) no chat template, the template fails on these messages, or the
            conversation has more characters than the context can hold as tokens.
    """
    tok = state.tokenizer
    template = state.settings.chat_template
    if template is not None and os.path.isfile(template):
        with open(template) as f:
            template = f.read()
    if template is None and not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; start the server with --chat-template")
    audio = audio_input.chat_audio(state.info, tok, template or tok.chat_template, req)
    try:
        text = tok.apply_chat_template(
            audio.messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=template,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as exc:  # jinja errors, bad kwargs
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from exc
    context = state.info.max_model_len
    if context and len(text) > 2 * context * state.max_token_chars:
        # certainly more tokens than the context holds: refuse before tokenising (a 30 MB
        # conversation took ~50 s and ~5 GB to tokenise, only to be refused afterwards)
        raise bad_request(
            f"the conversation ({len(text)} characters) is longer than this model's context of "
            f"{context} tokens",
            "messages",
        )
    prompt: dict[str, Any] = {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}
    if audio.clips:
        audio_input.check_placeholders(audio, text)
        prompt["multi_modal_data"] = {"audio": audio.clips}
    return prompt


def last_user_text(req: ChatCompletionRequest) -> str:
    """The text of the last user message that has any (the prompt of an image chat)."""
    for i, m in reversed(list(enumerate(req.messages))):
        if m.role == "user" and m.text(f"messages[{i}]").strip():
            return m.text(f"messages[{i}]")
    raise bad_request("messages need a user message with text", "messages")


# ---------------------------------------------------------------- completions
@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    """Text completions (LLM pipelines); one engine run per prompt, choices in prompt order."""
    state = get_state(request)
    req = parse_body(CompletionRequest, await read_json(request))
    if not (state.info.is_llm and "text" in state.info.output_kinds):
        raise bad_request(f"pipeline {state.info.pipeline!r} does not produce text completions")
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    req.refuse_tools()
    adapters = resolve_adapters(state, req.model, req.lora)
    params = stage_params(state, req.sampling_params(stream=req.stream), None)
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": served_model(state, req.model, adapters),
    }
    if req.stream:
        spec = TextStream(
            head,
            req.n,
            include_usage=req.include_usage,
            return_token_ids=req.return_token_ids,
            logprobs=req.logprobs,
            tokenizer=state.tokenizer,
        )
        runs = [StreamRun(prompt, params, adapters) for prompt in req.prompts()]
        return await stream_text(request, state, runs, spec)
    choices, total = [], dict(_NO_USAGE)
    for prompt in req.prompts():
        ro = text_output(await run_pipeline(state, prompt, params, adapters, request))
        for c in ro.outputs:
            choice = {
                "index": len(choices),
                "text": c.text,
                "finish_reason": c.finish_reason or "stop",
                "logprobs": None
                if req.logprobs is None
                else completion_logprobs(state.tokenizer, c.token_ids, c.logprobs),
            }
            if req.return_token_ids:
                choice["prompt_token_ids"] = list(ro.prompt_token_ids or [])
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        for k, v in usage(ro).items():
            total[k] += v
    return JSONResponse(head | {"choices": choices, "usage": total})
