"""The Qwen2.5-Omni thinker stage: vLLM's own ``Qwen2_5OmniThinkerForConditionalGeneration``.

Registered as ``OmniQwen2_5OmniThinkerForConditionalGeneration`` (:mod:`vllm_omni.models`).
Importing this module first makes vLLM's Qwen2-VL import path work without torchvision
(:mod:`vllm_omni.models.torchvision_free`), then re-exports vLLM's class unchanged: it loads a
whole Qwen2.5-Omni checkpoint (``thinker.*`` weights; the talker's and token2wav's are skipped)
and implements ``SupportsLoRA``.
"""

from __future__ import annotations

from vllm_omni.models.torchvision_free import ensure_qwen2_vl_importable

ensure_qwen2_vl_importable()

from vllm.model_executor.models.qwen2_5_omni_thinker import (  # noqa: E402
    Qwen2_5OmniThinkerForConditionalGeneration,
)

__all__ = ["Qwen2_5OmniThinkerForConditionalGeneration"]
