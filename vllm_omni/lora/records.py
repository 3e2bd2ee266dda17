"""What the adapter registry (:mod:`vllm_omni.lora.registry`) records of each adapter, and the identity
helpers it uses: :class:`AdapterRecord` (one version of one adapter) and :class:`StageState` (its state on
one stage)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.adapter_files import AdapterFiles
from vllm_omni.lora.request import LoRARequest, lora_request_problem

_INT_ID_MAX = 2**31 - 1


@dataclass(frozen=True)
class StageState:
    """An adapter's state on one stage (all its replicas): ``loaded``, ``pinned`` or ``failed`` (with
    ``error``: a restarted worker could not load it again; one line per replica that lost it).
    ``pinned`` is whether it is to be pinned there (kept while it is ``failed``); ``failed_replicas``
    the replica indices whose restart lost it (``(0,)`` on a stage without replicas), in order. A
    replicated stage sends requests naming it to the replicas that still hold it."""

    state: Literal["loaded", "pinned", "failed"]
    error: str | None = None
    pinned: bool = False
    failed_replicas: tuple[int, ...] = ()


@dataclass(frozen=True)
class AdapterRecord:
    """One adapter version as the registry knows it.

    Attributes:
        name / int_id: the public identity (what ``list_loras`` reports and ``remove_lora`` takes).
        location: the resolved path (``realpath``) of the adapter (a PEFT folder or a ``.safetensors`` file).
        files: its weights and config files.
        fingerprint: SHA-256 (hex) of the config and weights bytes: the version.
        engine: the ``LoRARequest`` the stages get (per-version name and id; see the module docstring).
        targets: the stage ids it is registered on (``()`` for an adapter only seen in requests).
        denoiser: the denoiser it targets on a two-denoiser stage, when given.
        registered: added by ``add_lora`` / a start-up flag / the HTTP route (listed in ``/v1/models``);
            ``False`` for an adapter a request named by path (loaded by its stage on demand).
        stages: ``{stage_id: StageState}`` for the target stages.
        source: how it entered (``"add_lora"``, ``"lora_path"``, ``"request"``).
        version: 1 for the first content registered under ``name``, +1 per new content.
    """

    name: str
    int_id: int
    location: str
    files: AdapterFiles
    fingerprint: str
    engine: LoRARequest
    targets: tuple[int, ...] = ()
    denoiser: str | None = None
    registered: bool = True
    stages: Mapping[int, StageState] = field(default_factory=dict)
    source: str = "add_lora"
    version: int = 1
    signature: tuple = ()  # (path, inode, size, mtime_ns) of each file when fingerprinted

    @property
    def request(self) -> LoRARequest:
        """The public form ``LoRARequest(name, int_id, location)``."""
        return LoRARequest(self.name, self.int_id, self.location)


def resolved_location(path: str) -> str:
    """The path's ``realpath`` (a URL is kept as given)."""
    return os.path.realpath(path) if "://" not in path else path


def derived_engine_id(int_id: int, key: tuple[str, str]) -> int:
    """A fresh engine id for ``int_id``'s content ``key`` ``(location, fingerprint)``: 31 bits of its SHA-256, never 0."""
    digest = hashlib.sha256(f"{int_id}|{key[0]}|{key[1]}".encode()).digest()
    return (int.from_bytes(digest[:4], "big") & _INT_ID_MAX) or 1


def describe_adapter(lora: LoRARequest) -> str:
    """``adapter '<name>' (id <id>, path '<path>')`` for messages."""
    return f"adapter {lora.lora_name!r} (id {lora.lora_int_id}, path {lora.lora_path!r})"


def checked_lora_request(lora: Any) -> LoRARequest:
    """``lora`` if it is a ``LoRARequest`` with a positive id and a path
    (:func:`vllm_omni.lora.request.lora_request_problem`).

    Raises:
        InvalidAdapterError: naming what is wrong.
    """
    problem = lora_request_problem(lora)
    if problem is not None:
        raise InvalidAdapterError(f"an adapter {problem}")
    return lora


def denoiser_error(message: str) -> InvalidAdapterError:
    """A refused ``denoiser`` of an adapter; its ``param`` attribute names the field for the HTTP
    layer's error body."""
    exc = InvalidAdapterError(message)
    exc.param = "denoiser"
    return exc
