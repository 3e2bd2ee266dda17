"""OpenAI-compatible HTTP server over ``AsyncOmni``.

Routes (one module per family under :mod:`.routes`): ``GET /health``, ``GET /metrics``,
``GET /version``, ``GET|POST /ping``, ``GET /ui`` (a page to try the pipeline), ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/images/generations``,
``POST /v1/images/edits`` (multipart), ``POST /v1/videos/generations``, ``POST /tokenize``,
``POST /detokenize`` (``/v1/embeddings``, ``/v1/responses`` and ``/v1/audio/speech`` answer 404 naming
what serves instead) and, when vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set, ``POST /v1/load_lora_adapter`` /
``POST /v1/unload_lora_adapter``. JSON routes take ``Content-Type: application/json`` bodies
only (415 otherwise); ``/v1/images/edits`` takes ``multipart/form-data``. With ``--api-key``
every ``/v1`` route needs ``Authorization: Bearer <key>``.

Handlers only parse and validate, then call ``AsyncOmni``; what they know about the pipeline
comes from its ``entry_stage_info``. Every failure is an OpenAI-style error object
(:mod:`.errors`); input problems are 400 (404 for an unknown ``model``), never 500.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from vllm_omni.entrypoints.async_omni import AsyncOmni
from vllm_omni.entrypoints.openai.errors import error_response, install_error_handlers, log_client_error
from vllm_omni.entrypoints.openai.limits import BodySizeLimitMiddleware, max_body_bytes
from vllm_omni.entrypoints.openai.metrics import RegistrationFailures, metrics_registry
from vllm_omni.entrypoints.openai.routes import adapters, chat, images, models, ops, tokens, unserved, videos
from vllm_omni.entrypoints.openai.settings import ServerSettings
from vllm_omni.entrypoints.openai.state import ServerState, make_state, register_startup_adapters

if TYPE_CHECKING:
    from vllm_omni.config.omni_config import VllmOmniConfig

__all__ = ["build_app", "make_state", "register_startup_adapters", "run_server"]

logger = logging.getLogger(__name__)


class APIKeyMiddleware:
    """Pure ASGI middleware: ``401`` on every ``/v1`` route without ``Authorization: Bearer <key>``.

    Active only when keys are configured (``--api-key``). Pure ASGI (not ``BaseHTTPMiddleware``)
    so that handlers see the client's disconnect and streamed responses are not buffered.
    """

    def __init__(self, app, keys: list[str] | tuple[str, ...]):
        self.app = app
        self.keys = set(keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys and scope["path"].startswith("/v1"):
            header = dict(scope.get("headers", ())).get(b"authorization", b"").decode("latin-1")
            if header.removeprefix("Bearer ").strip() not in self.keys:
                log_client_error(scope["method"], scope["path"], 401, "invalid or missing API key")
                return await error_response("invalid or missing API key", 401)(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application for one running ``AsyncOmni`` (see the module docstring)."""
    app = FastAPI(title="vllm-omni", version="0.1")
    app.state.omni_state = state
    app.state.registration_failures = RegistrationFailures()
    app.state.omni_metrics = metrics_registry(state.omni, app.state.registration_failures, state.base_name)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes())
    if state.settings.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=state.settings.api_keys)
    for family in (models, chat, images, videos, ops, tokens, unserved):
        app.include_router(family.router)
    if adapters.runtime_lora_updating_allowed():
        app.include_router(adapters.router)
    return app


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_server(
    config: VllmOmniConfig, settings: ServerSettings, listener: socket.socket | None = None
) -> None:
    """Start the engines of ``config`` (as resolved and checked by the CLI), then serve HTTP until interrupted.

    SIGTERM / SIGINT: the server stops accepting, lets in-flight requests finish for up to
    ``settings.shutdown_timeout`` seconds, cancels the rest (which aborts them in their stages),
    then shuts the stages down within as long again and exits with ``128 + signal``. A second
    SIGINT skips the drain. Every process the stages started exits with this one, also when it
    is killed outright (:mod:`vllm_omni.process_guard`).

    ``listener``: a socket bound to ``settings.host:settings.port`` before the engines started
    (:func:`vllm_omni.entrypoints.cli.preflight.take_listener`), served as is; ``None`` binds the
    address once the engines are up (uvicorn's own bind).

    Raises:
        ConfigError: a ``--lora-modules`` adapter cannot be served (before the server serves: a
            client that connected to ``listener`` meanwhile is disconnected).
        SystemExit: ``128 + signal number`` after a SIGTERM / SIGINT shutdown.
    """
    try:
        omni = AsyncOmni.from_config(config)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    try:
        state = make_state(omni, settings)
        asyncio.run(register_startup_adapters(state))
        app = build_app(state)
        host = settings.host or "0.0.0.0"
        port = settings.port if listener is None else listener.getsockname()[1]  # --port 0: the one bound
        logger.info("serving %s on http://%s:%s", state.base_name, f"[{host}]" if ":" in host else host, port)
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=host,
                port=settings.port,
                log_level=settings.uvicorn_log_level,
                access_log=not settings.disable_uvicorn_access_log,
                timeout_graceful_shutdown=settings.shutdown_timeout,  # type: ignore[arg-type]  # uvicorn waits a float
            )
        )
        # uvicorn handles the signals while it serves, then raises the one it received again
        # under the previous handler: the default SIGTERM action would kill this process before
        # the stages are shut down (their processes were left behind), so exit through Python.
        if threading.current_thread() is threading.main_thread():  # the only one signals reach
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, _exit_on_signal)
        server.run(sockets=None if listener is None else [listener])
    finally:
        omni.shutdown(timeout=settings.shutdown_timeout)
        if threading.current_thread() is threading.main_thread():
            _exit_without_teardown(sys.exc_info()[1])


def _exit_without_teardown(exc: BaseException | None) -> None:
    """End the server process once its stages are down, without the interpreter's teardown.

    Finalising the modules of a process that imported torch and vLLM took 3.3 s after the last
    ``atexit`` handler (measured on a tiny-model server under load 3): most of an idle server's
    stop. The ``atexit`` handlers still run (Ray's, multiprocessing's finalizers, logging);
    exceptions other than ``SystemExit`` keep their usual traceback and exit.
    """
    if exc is not None and not isinstance(exc, SystemExit):
        return
    code = 0 if exc is None else exc.code
    if not isinstance(code, int):
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
