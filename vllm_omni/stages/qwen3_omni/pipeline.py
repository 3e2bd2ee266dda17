"""How the Qwen3-Omni stages beyond the thinker are built.

:data:`STAGE_RUNTIMES` (model class -> :class:`~vllm_omni.engine.stage_registry.StageRuntimeEntry`)
is what :mod:`vllm_omni.stages` registers. The hand-offs are the Qwen2.5-Omni family's
(``thinker2talker``: the thinker's prompt and reply ids and the request's voice;
``talker2code2wav``: the talker's payload), registered by :mod:`vllm_omni.stages.qwen2_5_omni.pipeline`.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import AutoConfig

from vllm_omni.engine import step_io
from vllm_omni.engine.hidden_states_stage import HiddenStatesStageEngine
from vllm_omni.engine.llm_stage import LLMStageEngine
from vllm_omni.engine.stage_registry import InputProcessor, StageRuntimeEntry
from vllm_omni.errors import ConfigError
from vllm_omni.inputs.audio import AudioParams
from vllm_omni.stages.qwen2_5_omni.pipeline import feeds_a_talker
from vllm_omni.stages.qwen3_omni.code2wav import Code2WavStageEngine
from vllm_omni.stages.qwen3_omni.talker import TalkerStageEngine, default_talker_params

logger = logging.getLogger(__name__)

TALKER_ARCH = "OmniQwen3OmniMoeTalkerForConditionalGeneration"
CODE2WAV_ARCH = "OmniQwen3OmniMoeCode2Wav"


THINKER_ARCH = "OmniQwen3OmniMoeThinkerForConditionalGeneration"


def make_talker(stage: Any, config: Any) -> TalkerStageEngine:
    """The talker runtime; it speaks replies to prompts with audio when its thinker stage can return
    the hidden states of its capture layer (:func:`thinker_returns_layer_states`)."""
    source = (stage.engine_input_source or [stage.stage_id - 1])[0]
    media = config is not None and thinker_returns_layer_states(config.stage_by_id(source))
    return TalkerStageEngine(stage, takes_media=media)


def thinker_returns_layer_states(thinker: Any) -> bool:
    """Whether the thinker stage can run the stepping worker (:func:`~vllm_omni.engine.step_io.check_in_process`:
    one rank, the engine core in the stage's process)."""
    try:
        step_io.check_in_process(thinker, "speech for prompts with audio")
    except ConfigError as exc:
        logger.info("%s: speech for prompts with audio is off: %s", thinker.label, exc)
        return False
    return True


def make_thinker(stage: Any, config: Any) -> LLMStageEngine:
    """The thinker runtime. Feeding a talker (and able to), it returns, for prompts with
    ``multi_modal_data``, the hidden states of the talker's ``accept_hidden_layer`` (what
    transformers' Omni ``generate`` hands the talker at audio positions); a plain vLLM engine otherwise."""
    if (
        config is None
        or not feeds_a_talker(stage.stage_id, config)
        or not thinker_returns_layer_states(stage)
    ):
        return LLMStageEngine(stage)
    layer = int(AutoConfig.from_pretrained(stage.model).talker_config.accept_hidden_layer)
    return HiddenStatesStageEngine(stage, capture_layer=layer, wanted=_has_media)


def _has_media(prompt: Any) -> bool:
    return isinstance(prompt, dict) and bool(prompt.get("multi_modal_data"))


def make_code2wav(stage: Any, config: Any) -> Code2WavStageEngine:
    """The code2wav runtime (``config`` is not read)."""
    return Code2WavStageEngine(stage)


#: model class (a stage's ``model_arch``) -> how the engine runs it.
STAGE_RUNTIMES: dict[str, StageRuntimeEntry] = {
    THINKER_ARCH: StageRuntimeEntry(make_thinker),
    TALKER_ARCH: StageRuntimeEntry(make_talker, default_params=default_talker_params),
    CODE2WAV_ARCH: StageRuntimeEntry(make_code2wav, default_params=AudioParams),
}

#: input processors of this family: the Qwen2.5-Omni family's serve it.
INPUT_PROCESSORS: dict[str, InputProcessor] = {}
