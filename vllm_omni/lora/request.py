"""The request type for LoRA adapters, shared by LLM and diffusion stages.

``LoRARequest`` is vLLM's own class (``vllm.lora.request.LoRARequest``), re-exported so
that an adapter built for an LLM stage and one built for a diffusion stage are the same
object type: ``LoRARequest(lora_name, lora_int_id, lora_path)``. ``lora_int_id`` must be
a positive integer unique per adapter; :func:`stable_lora_int_id` derives one from a
path when the caller has none.
"""

from __future__ import annotations

import hashlib
import os

from vllm.lora.request import LoRARequest

__all__ = ["LoRARequest", "stable_lora_int_id"]


def stable_lora_int_id(path: str) -> int:
    """Deterministic positive 31-bit id for an adapter location.

    The id is ``sha256(realpath(path))`` truncated to 31 bits (0 mapped to 1), so it is
    stable across processes and restarts, and two different paths practically never
    share an id.
    """
    key = os.path.realpath(path) if "://" not in path else path
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    value = int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
    return value or 1
