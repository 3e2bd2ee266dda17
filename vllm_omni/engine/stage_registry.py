"""The engine's registry of stage runtimes for model classes stock vLLM / diffusers do not run.

The engine knows no model-specific runtime: a package above it (:mod:`vllm_omni.stages`)
registers its runtimes here when the entry point imports it, and the engine asks this registry.
A stage whose ``model_arch`` is registered is run by its entry's ``factory`` instead of a plain
vLLM engine; its per-request params are of ``params_type``, and front ends give it
``default_params()`` when a request says nothing about it.

Factories and input processors are top-level functions, so a worker process receives them
pickled by reference (unpickling imports their module, which registers its package again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: ``(source stage output, per-stage params, the request's entry adapter) -> next stage's prompt``.
InputProcessor = Callable[[Any, list[Any], Any], Any]


@dataclass(frozen=True)
class StageRuntimeEntry:
    """How the engine runs one model class.

    Attributes:
        factory: ``(stage, config) -> StageRuntime``; ``config`` is the whole resolved pipeline
            config (``VllmOmniConfig``), or ``None`` where the caller has none. A top-level function.
        params_type: the per-request params type the runtime takes (``None``: the stage kind's
            usual one, ``vllm.SamplingParams`` for LLM stages).
        default_params: returns a front end's params for the stage when a request gives none
            (``None``: the request's own LLM params apply).
    """

    factory: Callable[[Any, Any], Any]
    params_type: type | None = None
    default_params: Callable[[], Any] | None = None


_LOCK = threading.Lock()
_RUNTIMES: dict[str, StageRuntimeEntry] = {}
_INPUT_PROCESSORS: dict[str, InputProcessor] = {}


def register_stage_runtime(model_arch: str, entry: StageRuntimeEntry) -> None:
    """Run stages of ``model_arch`` with ``entry`` (idempotent for the same entry).

    Raises:
        ValueError: ``model_arch`` is already registered with another entry.
    """
    with _LOCK:
        known = _RUNTIMES.get(model_arch)
        if known is not None and known != entry:
            raise ValueError(f"stage runtime for {model_arch!r} is already registered: {known}")
        _RUNTIMES[model_arch] = entry


def register_input_processor(name: str, processor: InputProcessor) -> None:
    """Make ``processor`` the input processor ``name`` (``StageSpec.input_processor``) names.

    Raises:
        ValueError: ``name`` is already registered with another function.
    """
    with _LOCK:
        known = _INPUT_PROCESSORS.get(name)
        if known is not None and known is not processor:
            raise ValueError(f"input processor {name!r} is already registered: {known}")
        _INPUT_PROCESSORS[name] = processor


def stage_runtime_entry(stage: Any) -> StageRuntimeEntry | None:
    """The registered entry of ``stage``'s ``model_arch``, ``None`` when the stage is a plain
    vLLM or diffusion stage."""
    return _RUNTIMES.get(getattr(stage, "model_arch", None) or "")


def input_processor(name: str) -> InputProcessor | None:
    """The registered input processor ``name``, ``None`` when there is none."""
    return _INPUT_PROCESSORS.get(name)


def stage_params_type(stage: Any) -> type | None:
    """The params type of a registered stage, ``None`` when it is the stage kind's usual one."""
    entry = stage_runtime_entry(stage)
    return None if entry is None else entry.params_type


def default_stage_params(stage: Any) -> Any:
    """A front end's params for ``stage`` when a request gives none of its own (``None``: the
    request's LLM params apply, as for any LLM stage)."""
    entry = stage_runtime_entry(stage)
    if entry is None or entry.default_params is None:
        return None
    return entry.default_params()
