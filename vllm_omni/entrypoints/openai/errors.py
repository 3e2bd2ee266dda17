"""OpenAI-style error objects and the handlers that guarantee every failure gets one.

Body: ``{"error": {"message": str, "type": str, "param": str | null, "code": int}}``,
the shape the official ``openai`` client parses into ``openai.APIStatusError``.

Errors raised by ``AsyncOmni`` are mapped to a status here, by type only
(:func:`engine_error_to_openai`): user errors (:class:`~vllm_omni.errors.OmniUserError`,
vLLM's ``VLLMClientError`` and ``ValueError``) are 400, stage failures
(:class:`~vllm_omni.errors.StageEngineError`) are 500.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.exceptions import VLLMClientError

from vllm_omni.errors import (
    ClientDisconnected,
    InvalidAdapterError,
    LoRANotEnabledError,
    OmniUserError,
    OpenAIError,
    StageEngineError,
)

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param)


def not_found(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 404, param)


def engine_error_to_openai(
    exc: BaseException, adapter_param: str = "lora", user_param: str | None = None
) -> OpenAIError | None:
    """The client-facing error for an exception raised by ``AsyncOmni`` (by type, never by text).

    Args:
        exc: what the engine call raised.
        adapter_param: ``param`` of an adapter error (``InvalidAdapterError``,
            ``LoRANotEnabledError``): the request field that named the adapter, unless the
            error names its own (a ``param`` attribute, e.g. ``"denoiser"``).
        user_param: ``param`` of any other input error.

    Returns:
        ``exc`` itself when it is already an :class:`OpenAIError`; 500 for a
        :class:`~vllm_omni.errors.StageEngineError`; 400 for an adapter error, any other
        :class:`~vllm_omni.errors.OmniUserError`, vLLM's ``VLLMClientError`` and the
        ``ValueError`` / ``TypeError`` / ``KeyError`` vLLM raises on request validation;
        ``None`` for anything else (an unexpected error: the app's handler answers 500).
    """
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, StageEngineError):
        return OpenAIError(str(exc), 500)
    if isinstance(exc, InvalidAdapterError | LoRANotEnabledError):  # an error may name its own field
        return bad_request(str(exc), getattr(exc, "param", None) or adapter_param)
    if isinstance(exc, OmniUserError | VLLMClientError | ValueError | TypeError | KeyError):
        return bad_request(str(exc), getattr(exc, "param", None) or user_param)
    return None


@contextlib.contextmanager
def engine_errors(adapter_param: str = "lora", user_param: str | None = None) -> Iterator[None]:
    """Around an ``AsyncOmni`` call: re-raise its errors as :func:`engine_error_to_openai` maps them."""
    try:
        yield
    except Exception as exc:
        mapped = engine_error_to_openai(exc, adapter_param, user_param)
        if mapped is None or mapped is exc:
            raise
        raise mapped from exc


def _printable(text: str | None) -> str | None:
    """``text`` with what UTF-8 cannot encode (lone surrogates echoed from a request) escaped."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    """The OpenAI-style error body; any message (even one quoting invalid text) renders."""
    message, param = _printable(message) or message, _printable(param)
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


def log_client_error(method: str, path: str, status: int, message: str, param: str | None = None) -> None:
    """One INFO line per 4xx answer: ``400 POST /v1/images/generations: <message> (param lora)``.

    A client error is the client's, not a fault of the server (hence INFO, not WARNING), but an
    operator must be able to see why a request was refused without the client's copy.
    """
    text = " ".join(str(_printable(message)).split())
    if len(text) > 500:
        text = text[:500] + "..."
    suffix = f" (param {_printable(param)})" if param else ""
    logger.info("%d %s %s: %s%s", status, method, path, text, suffix)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception to an OpenAI-style error; 4xx answers are logged with their reason
    (:func:`log_client_error`), unexpected errors as 500s with their traceback."""

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        if exc.status < 500:
            log_client_error(request.method, request.url.path, exc.status, exc.message, exc.param)
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message = validation_message(exc)
        log_client_error(request.method, request.url.path, 400, message)
        return error_response(message, 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code < 500:
            log_client_error(request.method, request.url.path, exc.status_code, str(exc.detail))
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}", 500)
