"""``GET /health`` and ``GET /v1/models`` (the base model, then every named adapter)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from vllm_omni.entrypoints.openai.state import ServerState, get_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while every stage serves, 503 while any stage is down (its worker restarting or dead).

    The body is ``{"stages": {"<stage_id>": "starting" | "ready" | "restarting" | "dead"}}``.
    """
    stages = get_state(request).omni.stage_health()
    ok = all(state == "ready" for state in stages.values())
    body = {"stages": {str(i): state for i, state in stages.items()}}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    """OpenAI model list, each name once: every served name of the base model (``root``: its path),
    then each adapter of the engine's registry, however it was added (``root``: its files;
    ``parent``: the first served name). Names are one namespace (an adapter
    never takes a served name), so every listed id routes ``model`` to what it lists."""
    state = get_state(request)
    served = list(dict.fromkeys(state.settings.served_model_names)) or [state.base_name]
    data = [model_card(state, name, state.info.model, None) for name in served]
    data += [model_card(state, r.name, r.location, state.base_name) for r in state.registry.core.records()]
    return JSONResponse({"object": "list", "data": data})


def model_card(state: ServerState, name: str, root: str | None, parent: str | None) -> dict:
    """One ``model`` object of ``/v1/models``."""
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "vllm-omni",
        "root": root,
        "parent": parent,
    }
