"""``POST /v1/videos/generations``: a video from a text prompt (text-to-video pipelines) or from a prompt
and a first frame, ``input_reference`` (image-to-video pipelines)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_omni.entrypoints.openai import media
from vllm_omni.entrypoints.openai.errors import bad_request
from vllm_omni.entrypoints.openai.protocol import VideoGenerationRequest, parse_body
from vllm_omni.entrypoints.openai.routes.common import (
    read_json,
    run_diffusion,
)
from vllm_omni.entrypoints.openai.state import ServerState, get_state

router = APIRouter()

#: the request field of the input image, as OpenAI's ``POST /v1/videos`` names it
IMAGE_FIELD = "input_reference"


@router.post("/v1/videos/generations")
async def videos_generations(request: Request) -> JSONResponse:
    """``{"created", "data": [{"num_frames", "fps", "b64_json", "format"}]}``; ``video_format="png"``
    answers one base64 PNG per frame in ``frames`` (lossless) instead of an encoded video.

    The body is JSON (``input_reference``: base64 or a data URI) or multipart/form-data (``input_reference``:
    a PNG / JPEG / WebP file; other fields as text).
    """
    state = get_state(request)
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        fields, image = await media.read_image_form(request, (IMAGE_FIELD,), "videos/generations")
        req = parse_body(VideoGenerationRequest, fields)
    else:
        req = parse_body(VideoGenerationRequest, await read_json(request))
        image = (
            None if req.input_reference is None else media.image_from_base64(req.input_reference, IMAGE_FIELD)
        )
    _check_image(state, image)
    extra = {} if image is None else {"image": image}
    outputs = await run_diffusion(state, req, 1, request, produces="video", what="video", extra_args=extra)
    frames = media.video_frames(outputs)
    item: dict[str, Any] = {"num_frames": len(frames), "fps": req.fps}
    if req.video_format == "png":
        item.update(b64_json=None, format="png", frames=[media.png_b64(f) for f in frames])
    else:
        data, fmt = media.encode_video(frames, req.fps, req.video_format)
        item.update(b64_json=data, format=fmt)
    return JSONResponse({"created": int(time.time()), "data": [item]})


def _check_image(state: ServerState, image: Any) -> None:
    """An image-to-video stage needs ``input_reference`` (unless it also makes video from text alone: Wan2.2
    TI2V-5B); a text-to-video stage takes none.

    Raises:
        OpenAIError: (400, ``param`` ``input_reference``) either mismatch, naming the pipeline.
    """
    info = state.info
    if "video" not in info.output_kinds:
        return  # run_diffusion says the pipeline makes no video
    if image is not None and not info.accepts_input_image:
        raise bad_request(
            f"pipeline {info.pipeline!r} ({info.model_arch}) generates video from text only; "
            f"{IMAGE_FIELD} needs an image-to-video pipeline",
            IMAGE_FIELD,
        )
    if image is None and info.accepts_input_image and not info.input_image_optional:
        raise bad_request(
            f"pipeline {info.pipeline!r} ({info.model_arch}) makes video from an image: {IMAGE_FIELD} is "
            "required (a file in a multipart/form-data body, or base64 / a data:image URI in JSON)",
            IMAGE_FIELD,
        )
