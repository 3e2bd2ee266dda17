"""The server's shared state: the engine, its entry-stage description, the settings and the adapters.

One :class:`ServerState` per app (``app.state.omni_state``); handlers get it with
:func:`get_state`. :func:`make_state` builds it from a running ``AsyncOmni`` and
:func:`register_startup_adapters` registers ``--lora-path`` / ``--lora-modules`` before the
server accepts requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from transformers import AutoTokenizer

from vllm_omni.entrypoints.openai.lora import ServerAdapters
from vllm_omni.entrypoints.openai.settings import ServerSettings
from vllm_omni.entrypoints.stage_info import EntryStageInfo
from vllm_omni.errors import ConfigError
from vllm_omni.lora.request import LoRARequest


@dataclass
class ServerState:
    """What the handlers share.

    Attributes:
        omni: the running ``AsyncOmni`` (``generate``, ``add_lora``, ``remove_lora``).
        settings: the HTTP settings.
        registry: the server's view of the engine's adapter registry and the request-path rules.
        base_name: the name ``/v1/models`` lists first (``--served-model-name`` or the model).
        info: the pipeline's :class:`~vllm_omni.entrypoints.stage_info.EntryStageInfo`.
        created: start time (epoch seconds) shown on model cards.
        tokenizer: the LLM entry stage's tokenizer for chat templating (``None`` otherwise).
        max_token_chars: the most characters one token of ``tokenizer`` covers (its longest
            vocabulary entry): a text longer than the context × this is refused untokenised.
    """

    omni: Any
    settings: ServerSettings
    registry: ServerAdapters
    base_name: str
    info: EntryStageInfo
    created: int = field(default_factory=lambda: int(time.time()))
    tokenizer: Any = None
    max_token_chars: int = 1


def get_state(request: Request) -> ServerState:
    """The :class:`ServerState` of the app serving ``request``."""
    return request.app.state.omni_state


def make_state(omni: Any, settings: ServerSettings) -> ServerState:
    """Shared state for a running ``AsyncOmni`` (loads the chat tokenizer of an LLM entry stage)."""
    info: EntryStageInfo = omni.entry_stage_info
    served = settings.served_model_names
    base = served[0] if served else (info.model or "model")
    names = list(dict.fromkeys([base, *served, *([info.model] if info.model else [])]))
    registry = ServerAdapters(omni.adapter_registry, settings.lora_dirs, settings.allow_remote_lora, names)
    state = ServerState(omni=omni, settings=settings, registry=registry, base_name=base, info=info)
    if info.tokenizer is not None:
        state.tokenizer = AutoTokenizer.from_pretrained(
            info.tokenizer, trust_remote_code=info.trust_remote_code
        )
        state.max_token_chars = max(map(len, state.tokenizer.get_vocab()), default=1)
    return state


async def register_startup_adapters(state: ServerState) -> None:
    """Allow ``--lora-path`` paths in requests, check the names of the adapters the stages pre-loaded, and
    register ``--lora-modules`` (on the entry stage, the default target of the engine's registry).

    Raises:
        ConfigError: a start-up adapter whose name clashes, or a ``--lora-modules`` adapter that cannot be
            served (the server does not start).
    """
    reg = state.registry
    for path in state.info.startup_lora_paths:
        reg.register_startup_path(path)
    for record in reg.core.records():  # pre-loaded and pinned by their stage under this name and id
        if record.source == "lora_path" and record.name in reg.base_names:
            raise ConfigError(
                f"--lora-path {record.location}: adapter name {record.name!r}: {reg.name_clash(record.name)}"
            )
    for name, path in state.settings.lora_modules:
        location = reg.register_startup_path(path)
        lora = LoRARequest(name, reg.new_adapter_id(name, location), location)
        clash = reg.name_clash(name)  # before loading anything
        if clash is not None:
            raise ConfigError(f"--lora-modules {name}={path}: adapter name {name!r}: {clash}")
        try:
            await state.omni.add_lora(lora, replace=False)
        except Exception as exc:
            raise ConfigError(f"--lora-modules {name}={path}: {exc}") from exc
