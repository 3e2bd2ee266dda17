"""``POST /v1/videos/generations``: a video from a text prompt (video pipelines)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_omni.entrypoints.openai import media
from vllm_omni.entrypoints.openai.errors import bad_request
from vllm_omni.entrypoints.openai.protocol import VideoGenerationRequest, parse_body
from vllm_omni.entrypoints.openai.routes.common import (
    default_llm_params,
    read_json,
    resolve_adapters,
    run_pipeline,
    stage_params,
)
from vllm_omni.entrypoints.openai.state import get_state

router = APIRouter()


@router.post("/v1/videos/generations")
async def videos_generations(request: Request) -> JSONResponse:
    """``{"created", "data": [{"num_frames", "fps", "b64_json", "format"}]}``; ``video_format="png"``
    answers one base64 PNG per frame in ``frames`` (lossless) instead of an encoded video."""
    state = get_state(request)
    req = parse_body(VideoGenerationRequest, await read_json(request))
    if "video" not in state.info.output_kinds:
        raise bad_request(f"pipeline {state.info.pipeline!r} does not produce video")
    adapters = resolve_adapters(state, req.model, req.lora)
    dparams = req.diffusion_params(1)
    params = stage_params(state, default_llm_params(state), dparams)
    frames = media.video_frames(await run_pipeline(state, req.prompt, params, adapters, request))
    item: dict[str, Any] = {"num_frames": len(frames), "fps": req.fps}
    if req.video_format == "png":
        item.update(b64_json=None, format="png", frames=[media.png_b64(f) for f in frames])
    else:
        data, fmt = media.encode_video(frames, req.fps, req.video_format)
        item.update(b64_json=data, format=fmt)
    return JSONResponse({"created": int(time.time()), "data": [item]})
