"""How the Qwen3-Omni stages beyond the thinker are built.

:data:`STAGE_RUNTIMES` (model class -> :class:`~vllm_omni.engine.stage_registry.StageRuntimeEntry`)
is what :mod:`vllm_omni.stages` registers. The hand-offs are the Qwen2.5-Omni family's
(``thinker2talker``: the thinker's prompt and reply ids and the request's voice;
``talker2code2wav``: the talker's payload), registered by :mod:`vllm_omni.stages.qwen2_5_omni.pipeline`.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.engine.stage_registry import InputProcessor, StageRuntimeEntry
from vllm_omni.inputs.audio import AudioParams
from vllm_omni.stages.qwen3_omni.code2wav import Code2WavStageEngine
from vllm_omni.stages.qwen3_omni.talker import TalkerStageEngine, default_talker_params

TALKER_ARCH = "OmniQwen3OmniMoeTalkerForConditionalGeneration"
CODE2WAV_ARCH = "OmniQwen3OmniMoeCode2Wav"


def make_talker(stage: Any, config: Any) -> TalkerStageEngine:
    """The talker runtime (``config`` is not read)."""
    return TalkerStageEngine(stage)


def make_code2wav(stage: Any, config: Any) -> Code2WavStageEngine:
    """The code2wav runtime (``config`` is not read)."""
    return Code2WavStageEngine(stage)


#: model class (a stage's ``model_arch``) -> how the engine runs it.
STAGE_RUNTIMES: dict[str, StageRuntimeEntry] = {
    TALKER_ARCH: StageRuntimeEntry(make_talker, default_params=default_talker_params),
    CODE2WAV_ARCH: StageRuntimeEntry(make_code2wav, default_params=AudioParams),
}

#: input processors of this family: the Qwen2.5-Omni family's serve it.
INPUT_PROCESSORS: dict[str, InputProcessor] = {}
