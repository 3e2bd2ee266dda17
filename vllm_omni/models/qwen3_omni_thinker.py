"""The Qwen3-Omni thinker stage: vLLM's own ``Qwen3OmniMoeThinkerForConditionalGeneration``.

Registered as ``OmniQwen3OmniMoeThinkerForConditionalGeneration`` (:mod:`vllm_omni.models`).
Importing this module first makes vLLM's Qwen2-VL import path (which the Qwen3-Omni thinker
module imports through the Qwen2.5-Omni one) work without torchvision
(:mod:`vllm_omni.models.torchvision_free`), then exports vLLM's class: it loads a whole
Qwen3-Omni checkpoint (``thinker.*`` weights; the talker's and code2wav's are skipped) and
implements ``SupportsLoRA``. On CPU its MoE experts stay out of LoRA
(:func:`vllm_omni.models.moe_lora.keep_moe_experts_out_of_lora`, applied on import). With
torchvision installed the class is vLLM's, unchanged; without it, a subclass of the same name
whose multimodal processor is built without the video processor
(:mod:`vllm_omni.models.thinker_without_torchvision`: audio and image inputs, video refused).
"""

from __future__ import annotations

from vllm_omni.models.moe_lora import keep_moe_experts_out_of_lora
from vllm_omni.models.torchvision_free import ensure_qwen2_vl_importable, torchvision_available

ensure_qwen2_vl_importable()

from transformers import Qwen3OmniMoeProcessor  # noqa: E402
from vllm.model_executor.models import qwen3_omni_moe_thinker as _upstream  # noqa: E402

keep_moe_experts_out_of_lora()

if torchvision_available():
    Qwen3OmniMoeThinkerForConditionalGeneration = _upstream.Qwen3OmniMoeThinkerForConditionalGeneration
else:
    from vllm_omni.models.thinker_without_torchvision import thinker_class_without_torchvision

    Qwen3OmniMoeThinkerForConditionalGeneration = thinker_class_without_torchvision(
        _upstream.Qwen3OmniMoeThinkerForConditionalGeneration, Qwen3OmniMoeProcessor, __name__
    )

__all__ = ["Qwen3OmniMoeThinkerForConditionalGeneration"]
