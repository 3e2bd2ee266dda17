"""``POST /v1/videos/generations``: a video from a text prompt (video pipelines)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_omni.entrypoints.openai import media
from vllm_omni.entrypoints.openai.protocol import VideoGenerationRequest, parse_body
from vllm_omni.entrypoints.openai.routes.common import (
    read_json,
    run_diffusion,
)
from vllm_omni.entrypoints.openai.state import get_state

router = APIRouter()


@router.post("/v1/videos/generations")
async def videos_generations(request: Request) -> JSONResponse:
    """``{"created", "data": [{"num_frames", "fps", "b64_json", "format"}]}``; ``video_format="png"``
    answers one base64 PNG per frame in ``frames`` (lossless) instead of an encoded video."""
    state = get_state(request)
    req = parse_body(VideoGenerationRequest, await read_json(request))
    outputs = await run_diffusion(state, req, 1, request, produces="video", what="video")
    frames = media.video_frames(outputs)
    item: dict[str, Any] = {"num_frames": len(frames), "fps": req.fps}
    if req.video_format == "png":
        item.update(b64_json=None, format="png", frames=[media.png_b64(f) for f in frames])
    else:
        data, fmt = media.encode_video(frames, req.fps, req.video_format)
        item.update(b64_json=data, format=fmt)
    return JSONResponse({"created": int(time.time()), "data": [item]})
