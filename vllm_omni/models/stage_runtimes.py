"""Stage runtimes implemented in this package for model classes stock vLLM / diffusers do not run.

A pipeline stage whose ``model_arch`` is a key of :data:`STAGE_RUNTIMES` is run by that
runtime instead of a plain vLLM engine; its per-request params are of the type
:func:`stage_params_type` names.
"""

from __future__ import annotations

import importlib
from typing import Any

#: model_arch -> (module, runtime factory, params type or None for ``vllm.SamplingParams``)
STAGE_RUNTIMES: dict[str, tuple[str, str, str | None]] = {
    "OmniQwen2_5OmniTalkerForConditionalGeneration": (
        "vllm_omni.models.qwen2_5_omni.stages",
        "make_talker",
        None,
    ),
    "OmniQwen2_5OmniToken2WavModel": ("vllm_omni.models.qwen2_5_omni.stages", "make_code2wav", "AudioParams"),
}

#: input processor name (``StageSpec.input_processor``) -> (module, function); the function takes
#: ``(source stage output, per-stage params, the request's entry adapter)`` and returns the
#: next stage's prompt (a :class:`~vllm_omni.engine.connectors.StagePayload`).
INPUT_PROCESSORS: dict[str, tuple[str, str]] = {
    "thinker2talker": ("vllm_omni.models.qwen2_5_omni.stages", "thinker2talker"),
    "talker2code2wav": ("vllm_omni.models.qwen2_5_omni.stages", "talker2code2wav"),
}


def input_processor(name: str) -> Any:
    """The input processor ``name`` of :data:`INPUT_PROCESSORS`, ``None`` when not one of them."""
    entry = INPUT_PROCESSORS.get(name)
    return None if entry is None else getattr(importlib.import_module(entry[0]), entry[1])


def has_stage_runtime(stage: Any) -> bool:
    """Whether ``stage`` is run by a runtime of this package."""
    return getattr(stage, "model_arch", None) in STAGE_RUNTIMES


def make_in_tree_runtime(stage: Any, config: Any) -> Any:
    """Start the runtime of ``stage`` (``config``: the whole resolved pipeline config)."""
    module, factory, _ = STAGE_RUNTIMES[stage.model_arch]
    return getattr(importlib.import_module(module), factory)(stage, config)


def stage_params_type(stage: Any) -> type | None:
    """The params type a stage run here takes, ``None`` when it is the stage kind's usual one."""
    entry = STAGE_RUNTIMES.get(getattr(stage, "model_arch", None))
    if entry is None or entry[2] is None:
        return None
    return getattr(importlib.import_module(entry[0]), entry[2])
