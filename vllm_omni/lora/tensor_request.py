"""Adapters handed over in memory: :class:`TensorLoRARequest` (the RL rollout convention).

An RL trainer (verl, OpenRLHF, TRL-style loops) pushes its adapter to the rollout engine every step as a
``peft_config`` dict and a ``lora_tensors`` state dict, never through files. :class:`TensorLoRARequest`
is that hand-over: a subclass of vLLM's ``LoRARequest`` (so every path that takes a ``LoRARequest``
takes it) carrying

* ``peft_config``: what ``peft.LoraConfig(...).to_dict()`` gives (enum values and sets are made plain);
* ``lora_tensors``: what ``peft.get_peft_model_state_dict(model)`` gives (keys with or without
  peft's ``base_model.model.`` prefix; the prefix is added where missing).

The tensors are **copied** when the request is built (detached, contiguous, on the CPU): a trainer that
later updates its parameters in place changes nothing here until it sends a new request. The copy is
hashed once (:attr:`TensorLoRARequest.content_sha256`, the adapter's version for the registry), so the
same request used for many generations costs nothing more. ``lora_path`` is not a file: it defaults to
``tensors://<lora_name>`` and only names the adapter (no file is ever written or read for it).

Validation (shapes against the model, targets, finite values, rank limits, a LoRA config) happens at
``add_lora`` / request time on each stage with the same checks as adapter files
(:mod:`vllm_omni.engine.lora_validation` for LLM stages, the diffusion readers for diffusion stages).
Only the structure (a dict of string keys to floating-point tensors, a dict config) is checked here.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import msgspec
import torch
from vllm.lora.request import LoRARequest  # ours is vLLM's (re-exported by vllm_omni.lora.request)

from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.adapter_files import AdapterFiles, lora_config_from_dict

__all__ = ["PEFT_PREFIX", "TENSOR_SCHEME", "TensorLoRARequest", "in_memory_files", "tensor_identity"]

#: ``lora_path`` scheme of in-memory adapters (never a file).
TENSOR_SCHEME = "tensors://"
#: peft's wrapper prefix of state-dict keys (``get_peft_model_state_dict`` of a ``PeftModel``).
PEFT_PREFIX = "base_model.model."


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data: enums by value, sets sorted, tuples as lists."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(_plain(v) for v in value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _copied_tensors(tensors: Any, source: str) -> dict[str, torch.Tensor]:
    """Detached contiguous CPU copies of ``tensors`` keyed with peft's prefix.

    Raises:
        InvalidAdapterError: not a non-empty dict of str -> floating-point tensor (the key named).
    """
    if not isinstance(tensors, Mapping) or not tensors:
        raise InvalidAdapterError(f"{source}: lora_tensors must be a non-empty dict of str -> torch.Tensor")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidAdapterError(
                f"{source}: lora_tensors[{key!r}] must be a torch.Tensor under a str key, got {type(tensor).__name__}"
            )
        if not tensor.is_floating_point():
            raise InvalidAdapterError(
                f"{source}: lora_tensors[{key!r}] has dtype {tensor.dtype}, not a float dtype"
            )
        name = key if key.startswith(PEFT_PREFIX) else PEFT_PREFIX + key
        if name in out:
            raise InvalidAdapterError(
                f"{source}: lora_tensors has {key!r} with and without the {PEFT_PREFIX!r} prefix"
            )
        out[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return out


def _digest(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of the canonical config JSON, then each tensor's key, dtype, shape and bytes (keys sorted)."""
    digest = hashlib.sha256(b"config\0" + json.dumps(config, sort_keys=True, default=str).encode())
    for key in sorted(tensors):
        tensor = tensors[key]
        digest.update(f"\0{key}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


class TensorLoRARequest(LoRARequest, kw_only=True):  # type: ignore[call-arg]  # a msgspec Struct (vLLM, not analysed)
    """A LoRA adapter handed over in memory (see the module docstring).

    Keywords:
        lora_name / lora_int_id: as ``LoRARequest`` (``lora_int_id`` positive).
        peft_config: ``peft.LoraConfig(...).to_dict()`` (or the ``adapter_config.json`` content).
        lora_tensors: ``{key: tensor}``; ``lora_A`` ``[r, in_features]`` / ``lora_B`` ``[out_features, r]``
            per module, any float dtype; copied here.
        lora_path: optional, defaults to ``tensors://<lora_name>`` (a name, never a file).
        content_sha256: set by the constructor (do not pass it; a request rebuilt by pickling keeps it).

    Raises:
        InvalidAdapterError: ``peft_config`` not a dict or not a LoRA config (``peft_type``, no
            ``lora_alpha`` ...), ``lora_tensors`` not a non-empty dict of float tensors (key named).
        ValueError: ``lora_int_id`` < 1 (vLLM's own check).
    """

    peft_config: dict = msgspec.field(default_factory=dict)
    lora_tensors: dict = msgspec.field(default_factory=dict)
    content_sha256: str = ""

    def __post_init__(self) -> None:
        if not self.lora_path:  # type: ignore[has-type]  # a field of vLLM's LoRARequest (not analysed)
            self.lora_path = f"{TENSOR_SCHEME}{self.lora_name}"
        if not self.content_sha256:  # built by a caller (a rebuilt pickle keeps its owned copies)
            source = f"adapter {self.lora_name!r} (id {self.lora_int_id}, in memory)"
            if not isinstance(self.peft_config, Mapping):
                raise InvalidAdapterError(
                    f"{source}: peft_config must be a dict (peft.LoraConfig(...).to_dict())"
                )
            config = _plain(self.peft_config)
            lora_config_from_dict(config, source)  # a LoRA config peft reads (refusals name the field)
            self.peft_config = config
            self.lora_tensors = _copied_tensors(self.lora_tensors, source)
            self.content_sha256 = _digest(config, self.lora_tensors)
        super().__post_init__()

    def engine_form(self, lora_name: str, lora_int_id: int) -> TensorLoRARequest:
        """This adapter under another name / id, sharing the (already copied) tensors: no copy, no hash.

        Its ``lora_path`` names the content (``tensors://<name>#<first 16 hex of the hash>``): what the
        stages key in-memory adapters by, so two engines in one process never mix two contents.
        """
        base = self.lora_path.split("#", 1)[0]
        return TensorLoRARequest(
            lora_name=lora_name,
            lora_int_id=lora_int_id,
            lora_path=f"{base}#{self.content_sha256[:16]}",
            peft_config=self.peft_config,
            lora_tensors=self.lora_tensors,
            content_sha256=self.content_sha256,
        )

    @property
    def source(self) -> str:
        """How messages name it: ``adapter '<name>' (id <id>, in memory)``."""
        return f"adapter {self.lora_name!r} (id {self.lora_int_id}, in memory)"

    def nbytes(self) -> int:
        """Bytes held by the copied tensors."""
        return sum(t.numel() * t.element_size() for t in self.lora_tensors.values())


def in_memory_files(lora: TensorLoRARequest) -> AdapterFiles:
    """The :class:`AdapterFiles` the registry records for an in-memory adapter (its ``lora_path``; no file)."""
    return AdapterFiles(weights=lora.lora_path, config=None, is_directory=False)


def tensor_identity(lora: TensorLoRARequest) -> tuple[str, AdapterFiles, str, tuple]:
    """``(location, files, fingerprint, signature)`` of an in-memory adapter, as the registry's
    ``_identity`` gives them for files: location ``lora_path``, fingerprint :attr:`content_sha256`."""
    return lora.lora_path, in_memory_files(lora), lora.content_sha256, (TENSOR_SCHEME, lora.content_sha256)
