"""The Qwen2.5-Omni thinker stage: vLLM's own ``Qwen2_5OmniThinkerForConditionalGeneration``.

Registered as ``OmniQwen2_5OmniThinkerForConditionalGeneration`` (:mod:`vllm_omni.models`).
Importing this module first makes vLLM's Qwen2-VL import path work without torchvision
(:mod:`vllm_omni.models.torchvision_free`), then exports vLLM's class: it loads a whole
Qwen2.5-Omni checkpoint (``thinker.*`` weights; the talker's and token2wav's are skipped) and
implements ``SupportsLoRA``. With torchvision installed the class is vLLM's, unchanged; without
it, a subclass of the same name whose multimodal processor is built without the video processor
(:mod:`vllm_omni.models.thinker_without_torchvision`: audio and image inputs, video refused).
"""

from __future__ import annotations

from vllm_omni.models.torchvision_free import ensure_qwen2_vl_importable, torchvision_available

ensure_qwen2_vl_importable()

from transformers import Qwen2_5OmniProcessor  # noqa: E402
from vllm.model_executor.models import qwen2_5_omni_thinker as _upstream  # noqa: E402

if torchvision_available():
    Qwen2_5OmniThinkerForConditionalGeneration = _upstream.Qwen2_5OmniThinkerForConditionalGeneration
else:
    from vllm_omni.models.thinker_without_torchvision import thinker_class_without_torchvision

    Qwen2_5OmniThinkerForConditionalGeneration = thinker_class_without_torchvision(
        _upstream.Qwen2_5OmniThinkerForConditionalGeneration, Qwen2_5OmniProcessor, __name__
    )

__all__ = ["Qwen2_5OmniThinkerForConditionalGeneration"]
