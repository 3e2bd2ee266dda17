"""Operations routes: ``GET /metrics``, ``GET /version``, ``GET|POST /ping`` and the ``/ui`` page.

- ``/metrics``: Prometheus text (OpenMetrics when the scraper's ``Accept`` asks for it), rendered
  from :mod:`~vllm_omni.entrypoints.openai.metrics` on a worker thread; ``name[]=<family>`` keeps
  only the named families (prometheus_client's filter).
- ``/version``: ``{"version": <vLLM version>}`` as ``vllm serve`` answers, plus ``"vllm_omni_version"``.
- ``/ping``: what ``/health`` answers (200 while every stage serves, 503 otherwise), on GET and
  POST, as ``vllm serve`` answers it.
- ``/ui``: a page to try prompts, adapters, scales, schedules and grids (static files of
  ``vllm_omni/entrypoints/openai/static``, no build step; docs: ``docs/user_guide/ui.md``);
  ``/ui/info``: what the page needs to know about the pipeline.

Any query parameter these routes do not take is refused with 400 naming it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from importlib import resources
from typing import Any

import vllm
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import choose_encoder

from vllm_omni.entrypoints.openai.errors import bad_request, not_found
from vllm_omni.entrypoints.openai.routes.models import health
from vllm_omni.entrypoints.openai.state import get_state
from vllm_omni.version import __version__ as omni_version

router = APIRouter()

#: Files of the ``/ui`` page: name under ``/ui/`` -> media type.
UI_FILES = {"ui.html": "text/html; charset=utf-8", "ui.js": "text/javascript", "ui.css": "text/css"}


def check_query(request: Request, allowed: tuple[str, ...] = ()) -> None:
    """Refuse query parameters outside ``allowed`` (400 naming the first one)."""
    for key in request.query_params:
        if key not in allowed:
            takes = f"it takes only {', '.join(allowed)}" if allowed else "it takes none"
            raise bad_request(f"{request.url.path}: unknown query parameter {key!r} ({takes})", key)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The server's Prometheus series (every one listed in ``docs/user_guide/metrics.md``)."""
    check_query(request, ("name[]",))
    registry = request.app.state.omni_metrics
    names = request.query_params.getlist("name[]")
    if names:
        if any(not n.strip() for n in names):
            raise bad_request("/metrics: name[] must name a metric family, got an empty value", "name[]")
        registry = _Only(registry, set(names))
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    body = await asyncio.to_thread(encoder, registry)
    return Response(body, media_type=content_type)


class _Only:
    """The families of ``registry`` named in ``names`` (a family's name or one of its samples')."""

    def __init__(self, registry: Any, names: set[str]) -> None:
        self.registry = registry
        self.names = names

    def collect(self) -> Iterator[Any]:
        for family in self.registry.collect():
            if family.name in self.names or any(s.name in self.names for s in family.samples):
                yield family


@router.get("/version")
async def version(request: Request) -> JSONResponse:
    check_query(request)
    return JSONResponse({"version": vllm.__version__, "vllm_omni_version": omni_version})


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    check_query(request)
    return await health(request)


@router.get("/ui")
async def ui_page(request: Request) -> Response:
    """The page (``ui.html``); it loads ``/ui/ui.js`` and ``/ui/ui.css``."""
    return _ui_file(request, "ui.html")


@router.get("/ui/info")
async def ui_info(request: Request) -> JSONResponse:
    """What the page needs to know about the pipeline: ``{"model": served name, "pipeline",
    "is_llm": the entry stage is an LLM stage, "outputs": output kinds, "max_adapters": per request,
    "default_scale": of start-up adapters, "dir_adapters": [{"name", "path"}] the adapters found in
    ``--lora-dirs`` (a request names one by path; it loads on first use), "defaults":
    {"num_inference_steps", "guidance_scale", "from": where each came from} what a request that sets
    neither runs with (:mod:`vllm_omni.config.call_defaults`; ``null`` without a diffusion stage)}``."""
    check_query(request)
    state = get_state(request)
    info = state.info
    defaults = info.call_defaults
    return JSONResponse(
        {
            "model": state.base_name,
            "pipeline": info.pipeline,
            "is_llm": info.is_llm,
            "outputs": sorted(info.output_kinds),
            "max_adapters": info.max_adapters_per_request,
            "default_scale": info.startup_lora_scale,
            "defaults": defaults.as_dict() if defaults is not None else None,
            "dir_adapters": await asyncio.to_thread(dir_adapters, state.settings.lora_dirs),
        }
    )


#: At most this many ``--lora-dirs`` adapters are listed for the page.
MAX_DIR_ADAPTERS = 200


def dir_adapters(roots: list[str]) -> list[dict[str, str]]:
    """The adapters directly inside each ``--lora-dirs`` root: folders holding ``adapter_config.json``
    and ``.safetensors`` files (names as the folder or file is named; nothing is read)."""
    found: list[dict[str, str]] = []
    for root in roots:
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir() and os.path.isfile(os.path.join(entry.path, "adapter_config.json")):
                found.append({"name": entry.name, "path": entry.path})
            elif entry.is_file() and entry.name.endswith(".safetensors"):
                found.append({"name": entry.name.removesuffix(".safetensors"), "path": entry.path})
            if len(found) >= MAX_DIR_ADAPTERS:
                return found
    return found


@router.get("/ui/{name}")
async def ui_file(request: Request, name: str) -> Response:
    return _ui_file(request, name)


def _ui_file(request: Request, name: str) -> Response:
    check_query(request)
    if name not in UI_FILES:
        raise not_found(f"/ui/{name}: no such file (the page serves {', '.join(sorted(UI_FILES))})")
    body = resources.files("vllm_omni.entrypoints.openai").joinpath("static", name).read_bytes()
    return Response(body, media_type=UI_FILES[name], headers={"Cache-Control": "no-cache"})
