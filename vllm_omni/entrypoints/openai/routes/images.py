"""``POST /v1/images/generations`` (JSON) and ``POST /v1/images/edits`` (multipart with an input image)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_omni.entrypoints.openai import media
from vllm_omni.entrypoints.openai.errors import bad_request
from vllm_omni.entrypoints.openai.protocol import ImageGenerationRequest, parse_body
from vllm_omni.entrypoints.openai.routes.common import (
    output_images,
    read_json,
    run_diffusion,
)
from vllm_omni.entrypoints.openai.state import ServerState, get_state

router = APIRouter()


@router.post("/v1/images/generations")
async def images_generations(request: Request) -> JSONResponse:
    """Images from a text prompt: ``{"created", "output_format", "data": [{"b64_json": <image>}, ...]}``;
    ``output_format`` ``png`` (default), ``jpeg`` or ``webp`` (``output_compression`` 0-100 for the
    last two)."""
    state = get_state(request)
    req = parse_body(ImageGenerationRequest, await read_json(request))
    return JSONResponse(await generate_images(state, req, image=None, request=request))


@router.post("/v1/images/edits")
async def images_edits(request: Request) -> JSONResponse:
    """Images from a prompt and an input image (image-to-image pipelines); same reply as generations."""
    state = get_state(request)
    fields, image = await media.read_edit_form(request)
    req = parse_body(ImageGenerationRequest, fields)
    return JSONResponse(await generate_images(state, req, image=image, request=request))


async def generate_images(
    state: ServerState, req: ImageGenerationRequest, image: Any, request: Request | None = None
) -> dict:
    """Run an image request (``image``: the decoded input image of an edit, else ``None``).

    With ``request``, the run is cancelled when that client disconnects.

    Raises:
        OpenAIError: 400 when the pipeline makes no images or takes no input image; the
            engine's errors as mapped by :func:`~..errors.engine_errors`.
    """
    info = state.info
    if image is not None and not info.accepts_input_image:
        raise bad_request(
            f"pipeline {info.pipeline!r} ({info.model_arch}) generates from text only; "
            f"/v1/images/edits needs an image-to-image pipeline",
            "image",
        )
    extra = {} if image is None else {"image": image}
    outputs = await run_diffusion(
        state, req, req.n, request, produces="image", what="images", extra_args=extra
    )
    fmt, quality = req.output_format, req.output_compression
    return {
        "created": int(time.time()),
        "output_format": fmt,
        "data": [{"b64_json": media.image_b64(img, fmt, quality)} for img in output_images(outputs)],
    }
