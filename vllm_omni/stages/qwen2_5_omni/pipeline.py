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
    "make_code2wav",
    "make_talker",
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
    """The talker runtime; its pooling pass takes the options of the stage feeding it (the thinker).

    Raises:
        StageEngineError: no model directory, or no pipeline ``config`` to find the thinker's stage in.
    """
    source = (stage.engine_input_source or [stage.stage_id - 1])[0]
    if not stage.model:
        raise StageEngineError(f"{stage.label}: no model directory given for the talker stage")
    if config is None:
        raise StageEngineError(f"{stage.label}: the talker needs the pipeline config (its thinker's stage)")
    return TalkerStageEngine(stage, config.stage_by_id(source), load_speakers(stage.model))


def make_code2wav(stage: Any, config: Any) -> Code2WavStageEngine:
    """The code2wav runtime (``config`` is not read)."""
    return Code2WavStageEngine(stage)


def thinker2talker(thinker_output: Any, stage_params: list[Any], lora_request: Any) -> StagePayload:
    """The talker's input from the thinker's ``RequestOutput``: ``prompt_token_ids`` /
    ``output_token_ids`` (int64 ``[T]`` / ``[n]``); ``meta``: the thinker's adapter and the voice
    of the request (the ``AudioParams`` among ``stage_params``, if any)."""
    completion = thinker_output.outputs[0]
    voice = next((p.voice for p in stage_params if isinstance(p, AudioParams)), None)
    return StagePayload(
        {
            "prompt_token_ids": torch.tensor(list(thinker_output.prompt_token_ids or []), dtype=torch.long),
            "output_token_ids": torch.tensor(list(completion.token_ids), dtype=torch.long),
        },
        {"thinker_lora_request": lora_request, "voice": voice},
    )


def talker2code2wav(talker_output: Any, stage_params: list[Any], lora_request: Any) -> StagePayload:
    """code2wav's input: the talker's payload (``codes`` int64 ``[N]``)."""
    return talker_output.payload


#: model class (a stage's ``model_arch``) -> how the engine runs it.
STAGE_RUNTIMES: dict[str, StageRuntimeEntry] = {
    "OmniQwen2_5OmniTalkerForConditionalGeneration": StageRuntimeEntry(
        make_talker, default_params=default_talker_params
    ),
    "OmniQwen2_5OmniToken2WavModel": StageRuntimeEntry(
        make_code2wav, AudioParams, default_params=AudioParams
    ),
}

#: input processor name (``StageSpec.input_processor``) -> function.
INPUT_PROCESSORS: dict[str, InputProcessor] = {
    "thinker2talker": thinker2talker,
    "talker2code2wav": talker2code2wav,
}
