"""Stage runtimes implemented in this package for model classes stock vLLM / diffusers do not run.

A pipeline stage whose ``model_arch`` is a key of :data:`STAGE_RUNTIMES` is run by that
runtime instead of a plain vLLM engine; its per-request params are of the type
:func:`stage_params_type` names, and front ends give it :func:`default_stage_params` when the
request says nothing about it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

_QWEN_OMNI = "vllm_omni.models.qwen2_5_omni.stages"


@dataclass(frozen=True)
class StageRuntimeEntry:
    """Where a stage runtime lives: ``module``; its factory ``(stage, config) -> runtime``; the
    params type it takes (``None``: ``vllm.SamplingParams``); a function returning a front end's
    default params for it (``None``: the request's own LLM params)."""

    module: str
    factory: str
    params_type: str | None = None
    default_params: str | None = None


STAGE_RUNTIMES: dict[str, StageRuntimeEntry] = {
    "OmniQwen2_5OmniTalkerForConditionalGeneration": StageRuntimeEntry(
        _QWEN_OMNI, "make_talker", default_params="default_talker_params"
    ),
    "OmniQwen2_5OmniToken2WavModel": StageRuntimeEntry(
        _QWEN_OMNI, "make_code2wav", "AudioParams", default_params="AudioParams"
    ),
}

#: input processor name (``StageSpec.input_processor``) -> (module, function); the function takes
#: ``(source stage output, per-stage params, the request's entry adapter)`` and returns the
#: next stage's prompt (a :class:`~vllm_omni.engine.connectors.StagePayload`).
INPUT_PROCESSORS: dict[str, tuple[str, str]] = {
    "thinker2talker": (_QWEN_OMNI, "thinker2talker"),
    "talker2code2wav": (_QWEN_OMNI, "talker2code2wav"),
}


def _attr(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def input_processor(name: str) -> Any:
    """The input processor ``name`` of :data:`INPUT_PROCESSORS`, ``None`` when not one of them."""
    entry = INPUT_PROCESSORS.get(name)
    return None if entry is None else _attr(*entry)


def has_stage_runtime(stage: Any) -> bool:
    """Whether ``stage`` is run by a runtime of this package."""
    return getattr(stage, "model_arch", None) in STAGE_RUNTIMES


def make_in_tree_runtime(stage: Any, config: Any) -> Any:
    """Start the runtime of ``stage`` (``config``: the whole resolved pipeline config)."""
    entry = STAGE_RUNTIMES[stage.model_arch]
    return _attr(entry.module, entry.factory)(stage, config)


def stage_params_type(stage: Any) -> type | None:
    """The params type a stage run here takes, ``None`` when it is the stage kind's usual one."""
    entry = STAGE_RUNTIMES.get(getattr(stage, "model_arch", None))
    if entry is None or entry.params_type is None:
        return None
    return _attr(entry.module, entry.params_type)


def default_stage_params(stage: Any) -> Any:
    """A front end's params for ``stage`` when a request gives none of its own (``None``: the
    request's LLM params apply, as for any LLM stage)."""
    entry = STAGE_RUNTIMES.get(getattr(stage, "model_arch", None))
    if entry is None or entry.default_params is None:
        return None
    return _attr(entry.module, entry.default_params)()
