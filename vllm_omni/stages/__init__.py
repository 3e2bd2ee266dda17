"""Stage runtimes for model classes stock vLLM / diffusers do not run, above the engine.

Each model family's package declares its runtimes and the hand-offs between its stages
(``<family>/pipeline.py``: ``STAGE_RUNTIMES``, ``INPUT_PROCESSORS``); importing this package
registers them into the engine's registry (:mod:`vllm_omni.engine.stage_registry`), which
is how the engine runs them without importing anything from here. The entry points
(``Omni``, ``AsyncOmni``) import it; a worker process gets a stage's factory pickled by
reference, and unpickling it imports this package again.

=====================================================  =========================================
model class                                            runtime
=====================================================  =========================================
``OmniQwen2_5OmniTalkerForConditionalGeneration``      :class:`~.qwen2_5_omni.talker.TalkerStageEngine`
``OmniQwen2_5OmniToken2WavModel``                      :class:`~.qwen2_5_omni.code2wav.Code2WavStageEngine`
``OmniQwen3OmniMoeTalkerForConditionalGeneration``     :class:`~.qwen3_omni.talker.TalkerStageEngine` (transformers)
``OmniQwen3OmniMoeCode2Wav``                           :class:`~.qwen3_omni.code2wav.Code2WavStageEngine` (transformers)
=====================================================  =========================================
"""

from __future__ import annotations

from vllm_omni.engine.stage_registry import register_input_processor, register_stage_runtime
from vllm_omni.stages.qwen2_5_omni import pipeline as qwen2_5_omni
from vllm_omni.stages.qwen3_omni import pipeline as qwen3_omni

FAMILIES = (qwen2_5_omni, qwen3_omni)


def register_stage_runtimes() -> None:
    """Register every family's runtimes and input processors (idempotent)."""
    for family in FAMILIES:
        for model_arch, entry in family.STAGE_RUNTIMES.items():
            register_stage_runtime(model_arch, entry)
        for name, processor in family.INPUT_PROCESSORS.items():
            register_input_processor(name, processor)


register_stage_runtimes()

__all__ = ["FAMILIES", "register_stage_runtimes"]
