"""What ``serve`` asks the engine for (:class:`OmniLaunch`), importable by the CLI and the HTTP layer.

The command line (:mod:`vllm_omni.entrypoints.cli.serve`) fills it from its flags and resolves
the config once (``--dry-run`` prints it); the HTTP layer's own settings are
:class:`~vllm_omni.entrypoints.openai.settings.ServerSettings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.overrides import CLI_INPUT_NAMES


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

    def build_config(self) -> VllmOmniConfig:
        """Resolve the typed :class:`~vllm_omni.config.VllmOmniConfig` (no engine starts); errors name
        the command line's flags (``CLI_INPUT_NAMES``), and stages default to ``worker_backend="mp"``.

        Raises:
            ValueError / KeyError (``ConfigError`` where classified): the options do not resolve.
        """
        # here, not at the top: omni_base brings the engine and the stages, which ``serve``'s flag
        # errors never need (measured: `import ...cli.serve` 16.3 s CPU with them, 12.8 s without)
        from vllm_omni.entrypoints.omni_base import build_omni_config

        return build_omni_config(
            self.model,
            self.pipeline,
            self.deploy_config,
            input_names=CLI_INPUT_NAMES,
            default_worker_backend="mp",
            **self.options,
        )
