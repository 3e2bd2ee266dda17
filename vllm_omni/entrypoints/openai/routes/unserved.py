"""OpenAI routes this server does not serve, answered with a 404 that names what serves instead.

``POST /v1/embeddings`` (no pooling stage is served), ``POST /v1/responses`` (the Responses API:
``/v1/chat/completions`` serves the same models) and ``POST /v1/audio/speech`` (text-to-speech of a
given text: speech pipelines answer ``/v1/chat/completions`` with ``"modalities": ["text", "audio"]``,
speaking the model's own reply). The body is not read.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from vllm_omni.entrypoints.openai.errors import not_found

router = APIRouter()

#: route -> what serves instead
UNSERVED = {
    "/v1/embeddings": "embeddings are not served (no pooling stage); use vLLM's own server "
    "(`vllm serve <model> --runner pooling`) for an embedding model",
    "/v1/responses": "the Responses API is not served; use POST /v1/chat/completions (same models, "
    "adapters, streaming, logprobs and response_format)",
    "/v1/audio/speech": "text-to-speech of a given text is not served; a speech pipeline (qwen2_5_omni, "
    'qwen3_omni) speaks its reply on POST /v1/chat/completions with "modalities": ["text", "audio"] '
    'and "audio": {"voice": ..., "format": "wav"} (docs/user_guide/qwen2_5_omni.md)',
}


def _answer(path: str):
    async def unserved() -> Response:
        raise not_found(f"{path}: {UNSERVED[path]}")

    return unserved


for _path in UNSERVED:
    router.add_api_route(_path, _answer(_path), methods=["POST"], include_in_schema=False)
