"""What ``serve`` builds (:class:`OmniLaunch`) and how the HTTP layer serves it (:class:`ServerSettings`).

The command line (:mod:`vllm_omni.entrypoints.cli.serve`) fills both from its flags; the
server (:mod:`vllm_omni.entrypoints.openai.api_server`) reads only ``ServerSettings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Default of ``--shutdown-timeout`` (seconds).
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


@dataclass
class OmniLaunch:
    """What the command line asks ``Omni``/``AsyncOmni`` for: ``AsyncOmni(model, **omni_kwargs())``."""

    model: str | None
    pipeline: str | None = None
    deploy_config: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def omni_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``Omni``/``AsyncOmni`` (besides ``model``)."""
        return {"pipeline": self.pipeline, "deploy_config": self.deploy_config, **self.options}

    def build_config(self):
        """Resolve the typed :class:`~vllm_omni.config.VllmOmniConfig` (no engine starts).

        Raises:
            ValueError / KeyError (``ConfigError`` where classified): the options do not resolve.
        """
        from vllm_omni.config.overrides import CLI_INPUT_NAMES
        from vllm_omni.entrypoints.omni_base import build_omni_config

        return build_omni_config(
            self.model,
            self.pipeline,
            self.deploy_config,
            input_names=CLI_INPUT_NAMES,
            default_worker_backend="mp",
            **self.options,
        )


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
    chat_template: str | None = None
    response_role: str = "assistant"
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    #: Seconds a SIGTERM/SIGINT lets in-flight requests finish before they are aborted; the
    #: stages then get as long again to shut down (``--shutdown-timeout``).
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
