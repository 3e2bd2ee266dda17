"""LLM-stage model classes vllm_omni adds to vLLM's ``ModelRegistry``.

Each is registered lazily (``"module:Class"``), so nothing is imported until vLLM inspects or
loads the class, and vLLM's registry subprocess (which inspects a class in a fresh
interpreter) imports the vllm_omni module, which applies what the class needs first.

========================================================  ==========================================
architecture                                              class
========================================================  ==========================================
``OmniQwen2_5OmniThinkerForConditionalGeneration``         vLLM's ``Qwen2_5OmniThinkerForConditionalGeneration``
                                                          (:mod:`vllm_omni.models.qwen2_5_omni_thinker`)
``OmniQwen3OmniMoeThinkerForConditionalGeneration``       vLLM's ``Qwen3OmniMoeThinkerForConditionalGeneration``
                                                          (:mod:`vllm_omni.models.qwen3_omni_thinker`)
========================================================  ==========================================
"""

from __future__ import annotations

import threading

from vllm import ModelRegistry

#: ``{architecture: "module:Class"}`` of every class registered here.
OMNI_MODEL_CLASSES: dict[str, str] = {
    "OmniQwen2_5OmniThinkerForConditionalGeneration": (
        "vllm_omni.models.qwen2_5_omni_thinker:Qwen2_5OmniThinkerForConditionalGeneration"
    ),
    "OmniQwen3OmniMoeThinkerForConditionalGeneration": (
        "vllm_omni.models.qwen3_omni_thinker:Qwen3OmniMoeThinkerForConditionalGeneration"
    ),
}
_LOCK = threading.Lock()


def register_omni_models() -> None:
    """Register :data:`OMNI_MODEL_CLASSES` in vLLM's ``ModelRegistry`` (idempotent, thread-safe)."""
    with _LOCK:
        supported = set(ModelRegistry.get_supported_archs())
        for arch, target in OMNI_MODEL_CLASSES.items():
            if arch not in supported:
                ModelRegistry.register_model(arch, target)
