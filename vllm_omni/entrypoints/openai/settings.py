"""How the HTTP layer serves a pipeline (:class:`ServerSettings`).

The command line (:mod:`vllm_omni.entrypoints.cli.serve`) fills it from its flags, beside
what it asks the engine for (:class:`~vllm_omni.entrypoints.launch.OmniLaunch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Default of ``--shutdown-timeout`` (seconds).
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


@dataclass
class ServerSettings:
    """Settings of the HTTP layer (see :mod:`vllm_omni.entrypoints.openai.api_server`)."""

    host: str | None = None
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    served_model_names: list[str] = field(default_factory=list)
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    lora_dirs: list[str] = field(default_factory=list)
    allow_remote_lora: bool = False
    #: ``--prompt-lora-syntax``: A1111 ``<lora:name:weight>`` prompt tokens select adapters on image routes
    prompt_lora_syntax: bool = False
    chat_template: str | None = None
    response_role: str = "assistant"
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    #: Seconds a SIGTERM/SIGINT lets in-flight requests finish before they are aborted; the
    #: stages then get as long again to shut down (``--shutdown-timeout``).
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
