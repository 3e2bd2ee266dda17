"""Request-body size limit for the HTTP server.

A body past the limit is answered ``413`` with an OpenAI-style error before it is parsed
(a 50 MB chat message used to keep the event loop busy for minutes). The limit is
``VLLM_OMNI_MAX_REQUEST_BODY_MB`` mebibytes (default 32), enough for image edits.
"""

from __future__ import annotations

import json
import os

from vllm_omni.entrypoints.openai.errors import log_client_error

DEFAULT_MAX_BODY_MB = 32


def max_body_bytes() -> int:
    """The configured limit in bytes (``VLLM_OMNI_MAX_REQUEST_BODY_MB``, default 32 MiB)."""
    return int(float(os.environ.get("VLLM_OMNI_MAX_REQUEST_BODY_MB", DEFAULT_MAX_BODY_MB)) * 1024 * 1024)


class BodySizeLimitMiddleware:
    """Pure ASGI middleware: 413 when ``Content-Length`` or the streamed body exceeds ``max_bytes``."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, scope, send) -> None:
        message = f"request body exceeds {self.max_bytes} bytes (VLLM_OMNI_MAX_REQUEST_BODY_MB)"
        log_client_error(scope.get("method", ""), scope.get("path", ""), 413, message)
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "RequestTooLargeError",
                    "param": None,
                    "code": 413,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    return await self._reject(scope, send)
        seen = 0
        rejected = False

        async def limited_receive():
            nonlocal seen, rejected
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    rejected = True
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            if rejected:
                await self._reject(scope, send)


class _BodyTooLarge(Exception):
    pass
