"""Building one stage's runtime in this process: the layer every backend builds on.

The inline backend calls :func:`make_inline_runtime` in the orchestrator's process; a worker
process (``mp``) and a Ray actor (``ray``) call it in theirs. Which runtime a stage gets: the
factory a package above the engine registered for its ``model_arch``
(:mod:`~vllm_omni.engine.stage_registry`), else a vLLM engine (LLM stages) or the diffusion
engine (diffusion stages).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import BaseVllmOmniStageConfig
from vllm_omni.engine.diffusion_stage import DiffusionStageEngine, check_pipeline_class
from vllm_omni.engine.llm_stage import LLMStageEngine, check_model_class
from vllm_omni.engine.protocols import StageRuntime
from vllm_omni.engine.stage_registry import stage_runtime_entry
from vllm_omni.engine.vllm_process import engine_core_in_stage_process

#: ``(stage, config) -> StageRuntime``: how a stage's runtime is built (a top-level function, so
#: that it crosses into a worker process by reference).
RuntimeFactory = Callable[[BaseVllmOmniStageConfig, "VllmOmniConfig | None"], StageRuntime]


def worker_process_defaults() -> None:
    """Process defaults of a stage worker (an ``mp`` worker process or a Ray actor).

    The worker is the stage's process boundary (restarts, kill -9, placement), so vLLM's engine
    core runs inside it (:func:`~vllm_omni.engine.vllm_process.engine_core_in_stage_process`, as for
    every LLM stage). With vLLM's default, three processes per stage each imported torch and vLLM,
    and an idle tiny-model server took 11 s to stop (the executor worker's exit, then the core's).
    Call before the stage's runtime is built.
    """
    engine_core_in_stage_process()
    # per-process state of vLLM's CPU worker (vllm/v1/worker/cpu_worker.py sets it in the process it
    # runs in): inherited from a parent that ran an engine in-process, it is stale here, and vLLM
    # warns "Unknown vLLM environment variable detected" about it at start-up
    os.environ.pop("VLLM_DIST_IDENT", None)


def check_stage_model_class(stage: BaseVllmOmniStageConfig) -> None:
    """Fail before any engine is built when this installation has no implementation of the
    stage's model class (a registered stage runtime; else vLLM's ``ModelRegistry`` for LLM
    stages, an in-tree or ``diffusers`` pipeline class for diffusion stages).

    Raises:
        StageEngineError: naming the stage and the missing class.
    """
    if stage_runtime_entry(stage) is not None:
        return
    if stage.is_llm:
        check_model_class(stage)
    else:
        check_pipeline_class(stage)


def runtime_factory(stage: BaseVllmOmniStageConfig) -> RuntimeFactory | None:
    """The registered factory of ``stage``'s model class, ``None`` for plain vLLM / diffusion
    stages. A backend that builds the runtime in another process passes it along (the other
    process may not have imported the package that registered it)."""
    entry = stage_runtime_entry(stage)
    return None if entry is None else entry.factory


def make_inline_runtime(
    stage: BaseVllmOmniStageConfig,
    config: VllmOmniConfig | None = None,
    factory: RuntimeFactory | None = None,
) -> StageRuntime:
    """Start the runtime of one stage in this process.

    Args:
        stage: the resolved stage config.
        config: the whole pipeline config, read by registered runtimes (e.g. the Qwen2.5-Omni
            talker reads the options of the stage feeding it); ``None`` where there is none.
        factory: the stage's runtime factory (from :func:`runtime_factory` in the process that
            resolved the pipeline); default: the one registered here, else a vLLM engine or the
            diffusion engine by stage kind.

    Raises:
        StageEngineError: the stage failed to start.
    """
    factory = factory or runtime_factory(stage)
    if factory is not None:
        return factory(stage, config)
    if stage.is_llm:
        return LLMStageEngine(stage)
    return DiffusionStageEngine(stage)
