"""How the Qwen2.5-Omni stages beyond the thinker are built and chained.

:data:`STAGE_RUNTIMES` (model class -> :class:`~vllm_omni.engine.stage_registry.StageRuntimeEntry`)
and :data:`INPUT_PROCESSORS` (the ``thinker2talker`` / ``talker2code2wav`` hand-offs) are what
:mod:`vllm_omni.stages` registers into the engine's registry.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams

from vllm_omni.engine.connectors import StagePayload
from vllm_omni.engine.hidden_states_stage import (
    HIDDEN_STATES_ATTR,
    LAYER_HIDDEN_STATES_ATTR,
    HiddenStatesStageEngine,
)
from vllm_omni.engine.llm_stage import LLMStageEngine
from vllm_omni.engine.stage_registry import InputProcessor, StageRuntimeEntry
from vllm_omni.errors import StageEngineError
from vllm_omni.stages.qwen2_5_omni.code2wav import (
    AudioOutput,
    AudioParams,
    Code2WavStageEngine,
    load_speakers,
)
from vllm_omni.stages.qwen2_5_omni.talker import TalkerStageEngine

__all__ = [
    "INPUT_PROCESSORS",
    "STAGE_RUNTIMES",
    "AudioOutput",
    "AudioParams",
    "default_talker_params",
    "feeds_a_talker",
    "make_code2wav",
    "make_talker",
    "make_thinker",
    "talker2code2wav",
    "thinker2talker",
]

#: transformers' talker defaults (``generate``'s ``talker_*`` arguments), less the repetition
#: penalty this stage cannot apply; max_tokens is its ``talker_max_new_tokens``.
TALKER_DEFAULTS = {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "max_tokens": 4096}


def default_talker_params() -> SamplingParams:
    """``SamplingParams`` of the talker when a request gives none (:data:`TALKER_DEFAULTS`)."""
    return SamplingParams(**TALKER_DEFAULTS)


def make_talker(stage: Any, config: Any) -> TalkerStageEngine:
    """The talker runtime (``config`` is not read).

    Raises:
        StageEngineError: no model directory.
    """
    if not stage.model:
        raise StageEngineError(f"{stage.label}: no model directory given for the talker stage")
    return TalkerStageEngine(stage, load_speakers(stage.model))


def make_thinker(stage: Any, config: Any) -> LLMStageEngine:
    """The thinker runtime: a vLLM engine that also returns its hidden states
    (:class:`~vllm_omni.engine.hidden_states_stage.HiddenStatesStageEngine`) when a stage of
    ``config`` takes its output through ``thinker2talker``, else a plain one (thinker-only pipelines)."""
    if config is None or not feeds_a_talker(stage.stage_id, config):
        return LLMStageEngine(stage)
    return HiddenStatesStageEngine(stage)


def feeds_a_talker(stage_id: int, config: Any) -> bool:
    """Whether a stage of ``config`` takes stage ``stage_id``'s output through ``thinker2talker``."""
    for i, spec in enumerate(config.pipeline.stages):
        sources = config.stages[i].engine_input_source or [i - 1]
        if spec.input_processor == "thinker2talker" and stage_id in sources:
            return True
    return False


def make_code2wav(stage: Any, config: Any) -> Code2WavStageEngine:
    """The code2wav runtime (``config`` is not read)."""
    return Code2WavStageEngine(stage)


def thinker2talker(thinker_output: Any, stage_params: list[Any], lora_request: Any) -> StagePayload:
    """The talker's input from the thinker's ``RequestOutput``: ``prompt_token_ids`` /
    ``output_token_ids`` (int64 ``[T]`` / ``[n]``) and, when the thinker stage returned them
    (:data:`~vllm_omni.engine.hidden_states_stage.HIDDEN_STATES_ATTR`), ``hidden_states`` (float32
    ``[T + n - 1, E]``), and ``layer_hidden_states`` (same shape, the thinker's capture layer) when
    it returned those; ``meta``: the voice of the request (the
    ``AudioParams`` among ``stage_params``, if any) and the number of completions the thinker made
    (``completions``: the talkers speak the first and refuse more, naming ``n``)."""
    completion = thinker_output.outputs[0]
    voice = next((p.voice for p in stage_params if isinstance(p, AudioParams)), None)
    tensors = {
        "prompt_token_ids": torch.tensor(list(thinker_output.prompt_token_ids or []), dtype=torch.long),
        "output_token_ids": torch.tensor(list(completion.token_ids), dtype=torch.long),
    }
    for name, attr in (
        ("hidden_states", HIDDEN_STATES_ATTR),
        ("layer_hidden_states", LAYER_HIDDEN_STATES_ATTR),
    ):
        states = getattr(thinker_output, attr, None)
        if states is not None:
            tensors[name] = states
    return StagePayload(tensors, {"voice": voice, "completions": len(thinker_output.outputs)})


def talker2code2wav(talker_output: Any, stage_params: list[Any], lora_request: Any) -> StagePayload:
    """code2wav's input: the talker's payload (``codes`` int64 ``[N]``)."""
    return talker_output.payload


#: model class (a stage's ``model_arch``) -> how the engine runs it.
STAGE_RUNTIMES: dict[str, StageRuntimeEntry] = {
    "OmniQwen2_5OmniThinkerForConditionalGeneration": StageRuntimeEntry(make_thinker),
    "OmniQwen2_5OmniTalkerForConditionalGeneration": StageRuntimeEntry(
        make_talker, default_params=default_talker_params
    ),
    "OmniQwen2_5OmniToken2WavModel": StageRuntimeEntry(make_code2wav, default_params=AudioParams),
}

#: input processor name (``StageSpec.input_processor``) -> function.
INPUT_PROCESSORS: dict[str, InputProcessor] = {
    "thinker2talker": thinker2talker,
    "talker2code2wav": talker2code2wav,
}
