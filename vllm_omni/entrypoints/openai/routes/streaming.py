"""Incremental server-sent events for ``/v1/chat/completions`` and ``/v1/completions``.

The LLM stage runs the request with vLLM's ``RequestOutputKind.DELTA``; every engine step's new
text becomes one chunk (OpenAI's ``chat.completion.chunk`` / ``text_completion`` format): for
chat, each choice first gets a chunk carrying its ``role``; a choice's last chunk carries its
``finish_reason``; ``stream_options.include_usage`` adds a chunk with ``usage`` and no choices;
``data: [DONE]`` ends the stream.

Errors found before the first piece (a refused adapter, an invalid prompt) are answered as an
ordinary OpenAI error response; later ones as one ``data: {"error": ...}`` event before
``[DONE]``. When the client goes away Starlette cancels the streaming task, which cancels the
request in its stage.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from vllm_omni.entrypoints.openai.errors import engine_error_to_openai, engine_errors
from vllm_omni.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from vllm_omni.entrypoints.openai.routes.common import (
    SSE_DONE,
    Adapters,
    cancel_on_disconnect,
    sse_event,
    stream_pipeline,
)
from vllm_omni.entrypoints.openai.state import ServerState
from vllm_omni.errors import OpenAIError

logger = logging.getLogger(__name__)


@dataclass
class StreamRun:
    """One prompt to stream: what ``AsyncOmni.generate`` needs (LLM params with DELTA output)."""

    prompt: Any
    params: list[Any]
    adapters: Adapters
    last_stage: int | None = None  # the request ends after this stage (None: the last one)


@dataclass
class TextStream:
    """How to render the pieces of one streamed reply.

    Attributes:
        head: ``id``, ``object`` (``chat.completion.chunk`` or ``text_completion``), ``created``, ``model``.
        n: choices per prompt (choice ``index`` = prompt position × ``n`` + completion index).
        role: chat: the assistant role sent in each choice's first chunk; ``None`` for completions.
        include_usage: end with a ``usage`` chunk.
        return_token_ids: each chunk also carries its ``token_ids``.
        logprobs: chat: ``top_logprobs``, completions: ``logprobs`` of the request (``None``: each
            chunk's ``logprobs`` is ``null``); each chunk then carries its tokens' log-probabilities.
        tokenizer: decodes a token vLLM gave no text for (``logprobs``).
    """

    head: dict[str, Any]
    n: int
    role: str | None = None
    include_usage: bool = False
    return_token_ids: bool = False
    logprobs: int | None = None
    tokenizer: Any = None
    usage: dict[str, int] = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0})
    #: completions: characters of the tokens sent so far per choice index (the next ``text_offset``)
    sent_chars: dict[int, int] = field(default_factory=dict)

    def chunk(self, choices: list[dict[str, Any]]) -> str:
        return sse_event(self.head | {"choices": choices})

    def opening(self, offset: int) -> list[str]:
        """Chat: one chunk per choice of a prompt carrying the role (no content yet)."""
        if self.role is None:
            return []
        return [
            self.chunk(
                [{"index": offset + i, "delta": {"role": self.role, "content": ""}, "finish_reason": None}]
            )
            for i in range(self.n)
        ]

    def piece(self, ro: Any, offset: int, first: bool) -> list[str]:
        """The events of one DELTA ``RequestOutput`` of the prompt at choice ``offset``."""
        if first:
            self.usage["prompt_tokens"] += len(ro.prompt_token_ids or [])
        events = []
        for c in ro.outputs:
            self.usage["completion_tokens"] += len(c.token_ids)
            if not (c.text or c.finish_reason or (self.return_token_ids and c.token_ids)):
                continue
            index = offset + c.index
            choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": c.finish_reason}
            if self.role is None:
                choice["text"] = c.text
                if self.logprobs is not None:
                    start = self.sent_chars.get(index, 0)
                    logprobs = completion_logprobs(self.tokenizer, c.token_ids, c.logprobs, start)
                    choice["logprobs"] = logprobs
                    if logprobs is not None:  # offsets count the tokens' texts, as in a plain reply
                        self.sent_chars[index] = start + sum(map(len, logprobs["tokens"]))
            else:
                choice["delta"] = {"content": c.text} if c.text else {}
                if self.logprobs is not None:
                    choice["logprobs"] = chat_logprobs(self.tokenizer, c.token_ids, c.logprobs, self.logprobs)
            if self.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            events.append(self.chunk([choice]))
        return events

    def closing(self) -> list[str]:
        if not self.include_usage:
            return [SSE_DONE]
        usage = self.usage | {"total_tokens": self.usage["prompt_tokens"] + self.usage["completion_tokens"]}
        return [sse_event(self.head | {"choices": [], "usage": usage}), SSE_DONE]


async def stream_text(request: Request, state: ServerState, runs: list[StreamRun], spec: TextStream):
    """A ``text/event-stream`` response streaming ``runs`` one after the other.

    Raises:
        OpenAIError: the first prompt's engine errors before anything was sent (mapped by type).
        ClientDisconnected: the client went away before the first piece.
    """
    first_run = runs[0]
    pieces = stream_pipeline(
        state, first_run.prompt, first_run.params, first_run.adapters, first_run.last_stage
    )
    try:
        with engine_errors("lora"):
            first = await cancel_on_disconnect(request, anext(pieces, None))
    except BaseException:
        await pieces.aclose()
        raise
    return StreamingResponse(_events(state, runs, spec, pieces, first), media_type="text/event-stream")


async def _events(
    state: ServerState, runs: list[StreamRun], spec: TextStream, pieces: AsyncIterator[Any], first: Any
) -> AsyncIterator[str]:
    try:
        for i, run in enumerate(runs):
            if i:
                pieces, first = (
                    stream_pipeline(state, run.prompt, run.params, run.adapters, run.last_stage),
                    None,
                )
            offset = i * spec.n
            for event in spec.opening(offset):
                yield event
            async with contextlib.aclosing(pieces):
                n_seen = 0
                if first is not None and first.request_output is not None:
                    for event in spec.piece(first.request_output, offset, True):
                        yield event
                    n_seen = 1
                async for out in pieces:
                    if out.request_output is None:
                        continue
                    for event in spec.piece(out.request_output, offset, n_seen == 0):
                        yield event
                    n_seen += 1
    except Exception as exc:  # after the 200 header: report in the stream
        mapped = engine_error_to_openai(exc)
        if mapped is None:
            logger.exception("streaming failed")
            mapped = OpenAIError(f"internal server error: {type(exc).__name__}", 500)
        error = {
            "message": mapped.message,
            "type": "BadRequestError" if mapped.status < 500 else "InternalServerError",
        }
        yield sse_event({"error": error | {"param": mapped.param, "code": mapped.status}})
        yield SSE_DONE
        return
    for event in spec.closing():
        yield event
