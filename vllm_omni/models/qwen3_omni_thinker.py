"""The Qwen3-Omni thinker stage: vLLM's own ``Qwen3OmniMoeThinkerForConditionalGeneration``.

Registered as ``OmniQwen3OmniMoeThinkerForConditionalGeneration`` (:mod:`vllm_omni.models`).
Importing this module first makes vLLM's Qwen2-VL import path (which the Qwen3-Omni thinker
module imports through the Qwen2.5-Omni one) work without torchvision
(:mod:`vllm_omni.models.torchvision_free`), then re-exports vLLM's class unchanged: it loads a
whole Qwen3-Omni checkpoint (``thinker.*`` weights; the talker's and code2wav's are skipped) and
implements ``SupportsLoRA``. On CPU its MoE experts stay out of LoRA
(:func:`vllm_omni.models.moe_lora.keep_moe_experts_out_of_lora`, applied on import).
"""

from __future__ import annotations

from vllm_omni.models.moe_lora import keep_moe_experts_out_of_lora
from vllm_omni.models.torchvision_free import ensure_qwen2_vl_importable

ensure_qwen2_vl_importable()

from vllm.model_executor.models.qwen3_omni_moe_thinker import (  # noqa: E402
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

keep_moe_experts_out_of_lora()

__all__ = ["Qwen3OmniMoeThinkerForConditionalGeneration"]
