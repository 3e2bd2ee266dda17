"""OpenAI-style error objects and the handlers that guarantee every failure gets one.

Body: ``{"error": {"message": str, "type": str, "param": str | null, "code": int}}``,
the shape the official ``openai`` client parses into ``openai.APIStatusError``.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param)


def not_found(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 404, param)


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


def validation_message(exc: ValidationError | RequestValidationError, prefix: str = "") -> str:
    """One line per pydantic error: ``field.path: message``."""
    parts = []
    for err in exc.errors()[:10]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{prefix}{loc}: {err.get('msg')}" if loc else f"{prefix}{err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception to an OpenAI-style error; unexpected ones are logged as 500s."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError):
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return error_response(validation_message(exc), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}", 500)
