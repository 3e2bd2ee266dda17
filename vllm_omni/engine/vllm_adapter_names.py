"""The name an LLM stage hands vLLM for an adapter version, and its inverse.

vLLM keys prefix-cache blocks by an adapter's name and path (``vllm/v1/core/kv_cache_utils.py``) and
compares ``LoRARequest`` s by name; the adapter registry issues a new engine id for every version of a name
(:mod:`vllm_omni.lora.registry`), so an LLM stage names each version ``"<name>@<engine id>"``
(:func:`vllm_lora_request`) and the metrics turn it back into the name clients use
(:func:`public_adapter_name`).
"""

from __future__ import annotations

from vllm_omni.lora.request import LoRARequest


def vllm_lora_request(lora: LoRARequest) -> LoRARequest:
    """The form of ``lora`` handed to vLLM: named ``"<name>@<lora_int_id>"`` (the id keeps two versions of
    one name from sharing KV blocks)."""
    return LoRARequest(f"{lora.lora_name}@{lora.lora_int_id}", lora.lora_int_id, lora.lora_path)


def public_adapter_name(vllm_name: str) -> str:
    """The name clients use for an adapter an LLM stage handed vLLM as ``"<name>@<engine id>"``
    (:func:`vllm_lora_request`); a name without that suffix as is."""
    name, at, version = vllm_name.rpartition("@")
    return name if at and version.isdigit() else vllm_name
