"""Starting a stage's runtime on its worker backend, as one runtime or as replicas.

Above the backends: ``inline`` (:func:`~vllm_omni.engine.inline_runtime.make_inline_runtime`
in this process), ``mp`` (:class:`~vllm_omni.engine.workers.client.WorkerStageRuntime`, a
spawned worker process) and ``ray`` (:class:`~vllm_omni.engine.workers.ray_backend.RayStageRuntime`,
a Ray actor); ``stage.replicas`` of them sit behind a
:class:`~vllm_omni.engine.replicas.ReplicatedStageRuntime`. The orchestrator calls
:func:`make_stage_runtime` once per stage.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import BaseVllmOmniStageConfig
from vllm_omni.engine.inline_runtime import make_inline_runtime, runtime_factory
from vllm_omni.engine.placement import worker_env
from vllm_omni.engine.protocols import StageRuntime
from vllm_omni.engine.replicas import ReplicaFactory, start_replicas
from vllm_omni.engine.workers import WORKER_BACKENDS
from vllm_omni.engine.workers.client import WorkerStageRuntime
from vllm_omni.engine.workers.ray_backend import RayStageRuntime
from vllm_omni.errors import ConfigError

logger = logging.getLogger(__name__)


def check_worker_backend(value: Any, source: str = "worker_backend") -> str:
    """``value`` if it names a worker backend.

    Raises:
        ConfigError: naming ``source`` and the accepted values.
    """
    if value not in WORKER_BACKENDS:
        raise ConfigError(
            f"{source}: unknown worker backend {value!r}; choose one of {list(WORKER_BACKENDS)}",
            options=("worker_backend",),
        )
    return value


def require_ray() -> None:
    """Raises:
    ConfigError: Ray (the ``ray`` extra) cannot be imported."""
    try:
        import ray  # noqa: F401  (an optional extra: imported only when the backend is chosen)
    except ImportError as exc:
        raise ConfigError(
            "worker_backend 'ray' needs Ray, which is not installed: pip install 'vllm-omni[ray]'",
            options=("worker_backend",),
        ) from exc


def make_stage_runtime(
    stage: BaseVllmOmniStageConfig,
    worker_backend: str = "inline",
    *,
    make_one: ReplicaFactory | None = None,
    ray_address: str | None = None,
    config: VllmOmniConfig | None = None,
    thread_envs: list[dict[str, str]] | None = None,
) -> StageRuntime:
    """Start the runtime of one stage: ``stage.replicas`` runtimes on ``worker_backend``, behind a
    :class:`~vllm_omni.engine.replicas.ReplicatedStageRuntime` when more than one.

    Args:
        stage: the resolved stage config.
        worker_backend: ``"inline"`` (in this process), ``"mp"`` (a spawned worker process per
            replica: :class:`~vllm_omni.engine.workers.client.WorkerStageRuntime`, which sees only
            its replica's ``devices``: :func:`~vllm_omni.engine.placement.worker_env`) or ``"ray"``
            (a Ray actor per replica: ``RayStageRuntime``).
        make_one: builds replica ``i`` as ``make_one(stage, i)`` instead (tests).
        config: the whole pipeline config, read by registered stage runtimes
            (:mod:`~vllm_omni.engine.stage_registry`: the Qwen2.5-Omni talker reads its thinker
            stage's options). It travels, with the stage's registered factory, to the stage's
            worker process or actor, which run those stages like any other.
        ray_address: the Ray cluster (``ray`` only; default ``RAY_ADDRESS``, else a local one).
        thread_envs: ``mp`` only: the CPU thread variables of each replica's worker
            (:func:`~vllm_omni.engine.cpu_threads.plan_pipeline_threads`); ``None``: none.

    Raises:
        ConfigError: an unknown backend, or ``"ray"`` without Ray installed.
        StageEngineError: the stage failed to start (replicas already started are shut down).
    """
    check_worker_backend(worker_backend)
    if make_one is None:
        if worker_backend == "ray":
            require_ray()
        if worker_backend == "inline" and stage.devices:
            logger.warning(
                "%s: devices=%s is not applied to in-process runtimes (worker_backend 'inline'); "
                "they use this process's devices",
                stage.label,
                stage.devices,
            )

        def make_one(st: BaseVllmOmniStageConfig, index: int) -> StageRuntime:
            threads = thread_envs[index] if thread_envs else {}
            return make_replica(st, index, worker_backend, ray_address, threads, config)

    return start_replicas(stage, make_one)


def make_replica(
    stage: BaseVllmOmniStageConfig,
    index: int,
    worker_backend: str,
    ray_address: str | None,
    threads: dict[str, str] | None = None,
    config: VllmOmniConfig | None = None,
) -> StageRuntime:
    """Replica ``index`` of ``stage`` on ``worker_backend`` (see :func:`make_stage_runtime`);
    an ``mp`` worker gets ``threads`` and its device group's :func:`worker_env`; a worker or
    actor gets ``config`` and the stage's registered runtime factory."""
    factory = runtime_factory(stage)
    if worker_backend == "inline":
        return make_inline_runtime(stage, config, factory)
    if worker_backend == "mp":
        env = {**(threads or {}), **worker_env(stage, index)}
        return WorkerStageRuntime(stage, env=env, config=config, factory=factory)
    return RayStageRuntime(stage, address=ray_address, config=config, factory=factory)
