"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's runtime LoRA routes).

Mounted only when vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set (:func:`runtime_lora_updating_allowed`).
"""

from __future__ import annotations

import vllm.envs as envs
from fastapi import APIRouter, Request
from fastapi.responses import Response

from vllm_omni.entrypoints.openai.errors import bad_request, engine_errors, not_found
from vllm_omni.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, parse_body
from vllm_omni.entrypoints.openai.routes.common import read_json
from vllm_omni.entrypoints.openai.state import get_state
from vllm_omni.lora.request import LoRARequest

router = APIRouter()


def runtime_lora_updating_allowed() -> bool:
    """vLLM's switch for ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""
    return bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """Register an adapter in the engine's registry (on the entry stage) and name it
    (``model=<lora_name>`` selects it).

    ``load_inplace`` re-reads the files: new content is a new version (requests after this answer get
    it, never the old weights); the same content changes nothing. ``denoiser`` (vllm-omni) places
    the adapter on one denoiser of a two-denoiser stage for requests that name none.

    Errors: 400 for the base model's name, a name already loaded (unless ``load_inplace``),
    a refused path, a denoiser the stage lacks or an adapter a stage refuses (``param``:
    ``lora_path``); nothing stays loaded then.
    """
    state = get_state(request)
    req = parse_body(LoadLoRAAdapterRequest, await read_json(request))
    reg = state.registry
    try:  # refusals of the server itself (the stages count their own): /metrics, stage="server"
        clash = reg.name_clash(req.lora_name, replace=req.load_inplace)
        if clash is not None:
            raise bad_request(clash, "lora_name")
        location = reg.resolve_path(req.lora_path)
    except Exception:
        request.app.state.registration_failures.note(req.lora_name)
        raise
    lora = LoRARequest(req.lora_name, reg.new_adapter_id(req.lora_name, location), location)
    with engine_errors("lora_path", "lora_path"):
        await state.omni.add_lora(
            lora, reload=req.load_inplace, replace=req.load_inplace, denoiser=req.denoiser
        )
    return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    """Unregister a named adapter and remove it from the stages (404 for an unknown name)."""
    state = get_state(request)
    req = parse_body(UnloadLoRAAdapterRequest, await read_json(request))
    with engine_errors("lora_name", "lora_name"):
        removed = await state.omni.remove_lora_named(req.lora_name)  # atomic: one removal per registration
    if not removed:
        raise not_found(f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name")
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")
