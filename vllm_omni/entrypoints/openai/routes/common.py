"""What the route families share: body parsing, adapter resolution, running a prompt, reply pieces.

Nothing slow runs on the event loop: large bodies are parsed on a worker thread, and
``AsyncOmni`` submits requests (adapter validation) on its own threads. A request whose
client disconnects is cancelled in its stage (:func:`run_pipeline` races the disconnect;
a streaming response is cancelled by Starlette when its client goes away).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from vllm import SamplingParams

from vllm_omni.entrypoints.openai.errors import bad_request, engine_errors, not_found
from vllm_omni.entrypoints.openai.lora import parse_lora_field, prompt_lora_syntax
from vllm_omni.entrypoints.openai.state import ServerState
from vllm_omni.entrypoints.stage_info import seed_unseeded, seeded_stage_default
from vllm_omni.errors import ClientDisconnected, OpenAIError
from vllm_omni.lora.request import RequestAdapter

#: One request's adapters, validated (:func:`~vllm_omni.lora.request.validate_request_adapters`).
Adapters = tuple[RequestAdapter, ...]

T = TypeVar("T")

#: Bodies larger than this are parsed on a worker thread instead of the event loop.
_PARSE_ON_THREAD_BYTES = 256 * 1024


def require_json(request: Request) -> None:
    """Refuse a body that does not declare ``Content-Type: application/json`` (parameters allowed).

    A cross-site form may post ``text/plain`` or form bodies without a CORS preflight; JSON
    routes therefore accept JSON bodies only.

    Raises:
        OpenAIError: (415) another or no content type.
    """
    declared = request.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != "application/json":
        shown = declared[:100] or "none"
        raise OpenAIError(f"Content-Type must be application/json, got {shown!r}", 415)


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "body") from exc
    except RecursionError as exc:
        raise bad_request("request body is nested too deeply", "body") from exc


async def read_json(request: Request) -> Any:
    """The JSON body of ``request`` (parsed off the event loop when large).

    Raises:
        OpenAIError: (415) not declared as JSON; (400) not JSON, or nested too deeply.
    """
    require_json(request)
    body = await request.body()
    if len(body) < _PARSE_ON_THREAD_BYTES:
        return _parse_json(body)
    # the request keeps its own reference to the raw bytes; drop it once parsed
    request._body = b""
    return await asyncio.to_thread(_parse_json, body)


async def _disconnected(request: Request) -> None:
    """Return once the client has disconnected (the body must already have been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it when the client disconnects first.

    Raises:
        ClientDisconnected: the client went away (``work`` was cancelled).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
    if not task.cancelled() and task.done():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected


def resolve_adapters(state: ServerState, model: str | None, lora: Any) -> Adapters:
    """Adapters for one request from its ``model`` and ``lora`` fields (``None`` scale: the default),
    in the form ``AsyncOmni.generate(adapters=...)`` takes; the engine checks them against the stages
    (one validation site: :mod:`vllm_omni.entrypoints.request_adapters`, its errors name ``lora``).

    Raises:
        OpenAIError: 404 for an unknown ``model``; 400 for a malformed ``lora`` field or a path the
            server does not serve.
    """
    info = state.info
    chosen: list[RequestAdapter] = []
    if model is not None and model not in state.registry.base_names:
        record = state.registry.core.get(model)
        if record is None:
            raise not_found(f"The model `{model}` does not exist.", "model")
        chosen.append(RequestAdapter(record.request))
    # entries with a later "stage" (one each) come on top of the entry stage's limit
    specs = parse_lora_field(lora, max_items=info.max_adapters_per_request + len(info.stage_is_llm) - 1)
    with engine_errors("lora", "lora"):
        chosen.extend(
            RequestAdapter(state.registry.to_request(s), s.scale, s.stage, s.denoiser, s.text_encoder_scale)
            for s in specs
        )
    return tuple(chosen)


def served_model(state: ServerState, model: str | None, adapters: Adapters) -> str:
    """The ``model`` field of a reply: the entry stage's adapter(s) that served it, however they were
    chosen (``model``: the registered name; ``lora.name``; ``lora.path``: the name registered at that
    path, else the path; several joined by ``+``), else the requested served name, else the first one."""
    entry = [a for a in adapters if a.stage_id in (None, 0)]
    if entry:
        return "+".join(a.lora.lora_name for a in entry)
    return model or state.base_name


def stage_params(
    state: ServerState, llm_params: Any, diffusion_params: Any, audio_params: Any = None
) -> list[Any]:
    """One params object per stage: ``llm_params`` for LLM stages, ``diffusion_params`` for
    diffusion ones; a stage with its own defaults (a talker, an audio stage) gets those, an
    audio stage ``audio_params`` when given, and a later stage with defaults the request's seed.

    The request's seed (the body's ``seed``, carried by whichever of the params objects it built)
    reaches every stage whose params set none (:func:`~vllm_omni.entrypoints.stage_info.seed_unseeded`):
    an image request's LLM stage samples with it too, so a seeded request is reproducible end to end."""
    info = state.info
    seeds = [getattr(p, "seed", None) for p in (llm_params, diffusion_params, audio_params)]
    seed = next((s for s in seeds if s is not None), None)
    out = []
    for i, is_llm in enumerate(info.stage_is_llm):
        default = info.stage_defaults[i] if i < len(info.stage_defaults) else None
        if audio_params is not None and info.stage_is_audio[i]:
            out.append(audio_params)
        elif default is not None and i > 0:
            out.append(seeded_stage_default(default, llm_params))
        else:
            out.append(llm_params if is_llm else diffusion_params)
    return [seed_unseeded(p, seed) for p in out]


def default_llm_params(state: ServerState) -> Any:
    """Params of LLM stages behind a diffusion request (``None`` when the pipeline has none)."""
    if not state.info.has_llm_stage:
        return None

    return SamplingParams(max_tokens=64)


def stream_pipeline(
    state: ServerState, prompt: Any, params: list[Any], adapters: Adapters, last_stage: int | None = None
) -> AsyncIterator[Any]:
    """``AsyncOmni.generate`` for one prompt (each final output; pieces of a DELTA stage), ending
    after ``last_stage`` when given.

    Closing the iterator, or cancelling the task iterating it, cancels the request.
    """
    kwargs = {} if last_stage is None else {"last_stage": last_stage}
    return state.omni.generate(
        prompt,
        params,
        request_id=f"req-{uuid.uuid4().hex}",
        adapters=adapters,
        adapters_field="lora",
        **kwargs,
    )


async def run_pipeline(
    state: ServerState,
    prompt: Any,
    params: list[Any],
    adapters: Adapters,
    request: Request | None = None,
    last_stage: int | None = None,
) -> list[Any]:
    """Run one prompt and collect its final outputs; with ``request``, cancel it when that client leaves.

    Raises:
        OpenAIError: the engine's errors, mapped by type (:func:`~..errors.engine_errors`).
        ClientDisconnected: the client of ``request`` went away (the request was cancelled).
    """

    async def collect() -> list[Any]:
        with engine_errors("lora"):
            return [out async for out in stream_pipeline(state, prompt, params, adapters, last_stage)]

    if request is None:
        return await collect()
    return await cancel_on_disconnect(request, collect())


async def run_diffusion(
    state: ServerState,
    req: Any,
    n: int,
    request: Request | None,
    *,
    produces: str,
    what: str,
    extra_args: dict[str, Any] | None = None,
) -> list[Any]:
    """Run an image or video request (``req``: a body with ``prompt``, ``model``, ``lora`` and
    ``diffusion_params``) and collect its final outputs; ``n`` outputs per prompt.

    Raises:
        OpenAIError: 400 when no final stage produces ``produces`` (``"image"``, ``"video"``;
            the message says ``what``); the errors of :func:`resolve_adapters` and :func:`run_pipeline`.
    """
    info = state.info
    if produces not in info.output_kinds:
        raise bad_request(f"pipeline {info.pipeline!r} does not produce {what}")
    dparams = req.diffusion_params(n, info.call_defaults)
    prompt, lora = req.prompt, req.lora
    if produces == "image":  # A1111 <lora:name:weight> tokens (--prompt-lora-syntax)
        prompt, lora = prompt_lora_syntax(prompt, lora, state.settings.prompt_lora_syntax)
    adapters = resolve_adapters(state, req.model, lora)
    dparams.extra_args.update(extra_args or {})
    params = stage_params(state, default_llm_params(state), dparams)
    try:
        return await run_pipeline(state, prompt, params, adapters, request)
    except OpenAIError as exc:  # a side the model refuses: name the field the request set it with
        if exc.param in ("height", "width") and getattr(req, "size", None):
            exc.param = "size"
        raise


def text_output(outputs: list[Any]) -> Any:
    """The last text (vLLM ``RequestOutput``) among ``outputs``; 500 when there is none."""
    texts = [o for o in outputs if o.request_output is not None]
    if not texts:
        raise OpenAIError("the pipeline returned no text output", 500)
    return texts[-1].request_output


def output_images(outputs: list[Any]) -> list[Any]:
    """Every image among ``outputs``; 500 when there is none."""
    found = [img for o in outputs for img in (o.images or [])]
    if not found:
        raise OpenAIError("the pipeline returned no image", 500)
    return found


def usage(ro: Any) -> dict[str, int]:
    """OpenAI ``usage`` of one vLLM ``RequestOutput``."""
    prompt = len(ro.prompt_token_ids or [])
    completion = sum(len(c.token_ids) for c in ro.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse_event(chunk: dict) -> str:
    """One server-sent event carrying ``chunk`` as JSON."""
    return f"data: {json.dumps(chunk)}\n\n"


#: The event that ends every OpenAI stream.
SSE_DONE = "data: [DONE]\n\n"


def sse(chunks: list[dict]) -> Response:
    """A complete ``text/event-stream`` body: one ``data:`` event per chunk, then ``[DONE]``."""
    return Response("".join(map(sse_event, chunks)) + SSE_DONE, media_type="text/event-stream")
