"""What the route families share: body parsing, adapter resolution, running a prompt, reply pieces."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm_omni.entrypoints.openai.errors import OpenAIError, bad_request, engine_errors, not_found
from vllm_omni.entrypoints.openai.lora import parse_lora_field
from vllm_omni.entrypoints.openai.state import ServerState
from vllm_omni.lora.request import RequestAdapter, validate_request_adapters

#: One request's adapters, validated (:func:`~vllm_omni.lora.request.validate_request_adapters`).
Adapters = tuple[RequestAdapter, ...]


async def read_json(request: Request) -> Any:
    """The JSON body of ``request``.

    Raises:
        OpenAIError: (400) not JSON, or nested too deeply.
    """
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise bad_request("request body is nested too deeply") from exc


def resolve_adapters(state: ServerState, model: str | None, lora: Any) -> Adapters:
    """Adapters for one request from its ``model`` and ``lora`` fields (``None`` scale: the default).

    Raises:
        OpenAIError: 404 for an unknown ``model``; 400 for a malformed or refused ``lora``
            (the list rules are :func:`~vllm_omni.lora.request.validate_request_adapters`).
    """
    info = state.info
    limit = info.max_adapters_per_request
    chosen: list[RequestAdapter] = []
    if model is not None and model not in state.registry.base_names:
        if model not in state.registry.named:
            raise not_found(f"The model `{model}` does not exist.", "model")
        chosen.append(RequestAdapter(state.registry.named[model]))
    specs = parse_lora_field(lora, max_items=limit)
    chosen.extend(RequestAdapter(state.registry.to_request(spec), spec.scale) for spec in specs)
    if info.is_llm and (len(chosen) > 1 or any(a.scale not in (None, 1.0) for a in chosen)):
        raise bad_request(
            f"{info.label} is an LLM stage: vLLM applies one adapter per request, at scale 1.0", "lora"
        )
    with engine_errors("lora"):
        return validate_request_adapters(chosen, limit, field="lora")


def stage_params(state: ServerState, llm_params: Any, diffusion_params: Any) -> list[Any]:
    """One params object per stage: ``llm_params`` for LLM stages, ``diffusion_params`` for the rest."""
    return [llm_params if is_llm else diffusion_params for is_llm in state.info.stage_is_llm]


def default_llm_params(state: ServerState) -> Any:
    """Params of LLM stages behind a diffusion request (``None`` when the pipeline has none)."""
    if not state.info.has_llm_stage:
        return None
    from vllm import SamplingParams

    return SamplingParams(max_tokens=64)


async def run_pipeline(state: ServerState, prompt: Any, params: list[Any], adapters: Adapters) -> list[Any]:
    """Run one prompt and collect its final outputs.

    Raises:
        OpenAIError: the engine's errors, mapped by type (:func:`~..errors.engine_errors`).
    """
    outputs = []
    with engine_errors("lora"):
        async for out in state.omni.generate(
            prompt, params, request_id=f"req-{uuid.uuid4().hex}", adapters=adapters
        ):
            outputs.append(out)
    return outputs


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


def sse(chunks: list[dict]) -> Response:
    """A complete ``text/event-stream`` body: one ``data:`` event per chunk, then ``[DONE]``."""
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return Response(body, media_type="text/event-stream")
