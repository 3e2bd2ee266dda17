"""What a multimodal LLM stage takes as input (for its :class:`~vllm_omni.engine.protocols.StageDescription`)."""

from __future__ import annotations

from typing import Any


def media_inputs(model_config: Any) -> dict[str, Any]:
    """``media_limits`` and ``audio_sample_rate`` of a stage's description: a multimodal model's input
    limits per prompt as vLLM's processing info resolves them (the model's support and
    ``limit_mm_per_prompt``; zeros left out) and, when it takes audio, its feature extractor's sample
    rate; empty limits and no rate for a text-only model."""
    limits: dict[str, int] = {}
    rate = None
    if getattr(model_config, "is_multimodal_model", False):
        from vllm.multimodal import MULTIMODAL_REGISTRY

        info = MULTIMODAL_REGISTRY.get_processing_info(model_config)
        limits = {m: int(n) for m, n in info.allowed_mm_limits.items() if n}
        if "audio" in limits and hasattr(info, "get_feature_extractor"):
            rate = int(info.get_feature_extractor().sampling_rate)
    return {"media_limits": limits, "audio_sample_rate": rate}
