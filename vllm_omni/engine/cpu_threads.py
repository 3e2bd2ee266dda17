"""CPU thread planning for the process workers of a pipeline.

Every process sizes its own torch / OpenMP thread pool to all the host's cores, and vLLM's CPU
worker binds its OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``: the same cores
for every engine of the host). With one process per stage (and per replica) the pools overlap on
the same cores, and OpenMP's spin-waiting threads of one worker take the cores another needs.

The rule, applied when the orchestrator starts ``mp`` workers for stages that run on CPU (the
stage sets ``devices: cpu``, or sets no ``devices`` on a host without CUDA): the cores this process
may run on (``os.sched_getaffinity(0)``) are split, in order, into one contiguous range per CPU
worker (all stages x replicas, in stage then replica order; the first ``cores % workers`` ranges
get one core more). Each worker gets (when there are at least two)

* ``OMP_NUM_THREADS``: the size of its range;
* ``VLLM_CPU_OMP_THREADS_BIND``: its range (``"0-3"``), split into one range per rank
  (``"0-1|2-3"``) for a stage whose vLLM world size (TP x PP) is above 1, or ``"nobind"`` when
  the range has fewer cores than ranks (always the case with fewer cores than workers, where
  every worker gets one thread).

A variable already set in this process's environment is the user's and is never replaced (the
worker inherits it). When the user set ``OMP_NUM_THREADS``, the binding is left alone too:
vLLM sets a bound worker's thread count from its binding. ``inline`` and ``ray`` workers are not
planned.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from vllm.platforms import current_platform

if TYPE_CHECKING:
    from vllm_omni.config.stage_config import BaseVllmOmniStageConfig

logger = logging.getLogger(__name__)

THREADS = "OMP_NUM_THREADS"
BIND = "VLLM_CPU_OMP_THREADS_BIND"
NOBIND = "nobind"


def _ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the list syntax of ``VLLM_CPU_OMP_THREADS_BIND``)."""
    parts: list[str] = []
    start = prev = ids[0]
    for i in list(ids[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def _split(items: Sequence[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` contiguous slices; the first ``len % parts`` get one more."""
    size, extra = divmod(len(items), parts)
    out, pos = [], 0
    for k in range(parts):
        n = size + (1 if k < extra else 0)
        out.append(list(items[pos : pos + n]))
        pos += n
    return out


def plan_cpu_threads(
    cores: Sequence[int], ranks: Sequence[int], user_env: Mapping[str, str] | None = None
) -> list[dict[str, str]]:
    """The thread variables of each CPU worker (the rule of this module).

    Args:
        cores: the host cores to share (ids, e.g. ``sorted(os.sched_getaffinity(0))``).
        ranks: one entry per worker, in worker order: its OpenMP ranks (vLLM world size; 1 for a
            diffusion stage).
        user_env: the environment the workers inherit (default ``os.environ``); a variable set
            there is not planned.

    Returns:
        One dict per worker, e.g. for 2 cores and 2 workers
        ``[{"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}, {... "1"}]``; for 2 cores
        and 3 workers every worker gets ``{"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND":
        "nobind"}``. Empty dicts when there are no cores or the user set both variables.
    """
    env = os.environ if user_env is None else user_env
    cores = sorted(cores)
    if not ranks or not cores:
        return [{} for _ in ranks]
    plans: list[dict[str, str]] = []
    shared = len(cores) < len(ranks)
    slices = [[] for _ in ranks] if shared else _split(cores, len(ranks))
    for own, n_ranks in zip(slices, ranks):
        plan = {THREADS: str(max(1, len(own)))}
        if shared or len(own) < n_ranks:
            plan[BIND] = NOBIND
        else:
            plan[BIND] = "|".join(_ranges(part) for part in _split(own, n_ranks))
        if THREADS in env:
            plan = {}
        elif BIND in env:
            plan.pop(BIND)
        plans.append(plan)
    return plans


def runs_on_cpu(stage: BaseVllmOmniStageConfig, cpu_host: bool) -> bool:
    """Whether ``stage``'s workers compute on CPU: ``devices: cpu``, or no ``devices`` on a
    host without CUDA (``cpu_host``)."""
    return stage.devices == ["cpu"] or (not stage.devices and cpu_host)


def plan_pipeline_threads(
    stages: Sequence[BaseVllmOmniStageConfig],
    worker_backend: str,
    *,
    cpu_host: bool | None = None,
    cores: Sequence[int] | None = None,
    user_env: Mapping[str, str] | None = None,
) -> dict[int, list[dict[str, str]]]:
    """The thread variables of every replica of every stage (``{stage_id: [env per replica]}``).

    Args:
        stages: the pipeline's resolved stage configs.
        worker_backend: only ``"mp"`` is planned (other backends: ``{}``).
        cpu_host: the host has no CUDA (default: vLLM's platform is CPU).
        cores: the cores to share (default ``os.sched_getaffinity(0)``).
        user_env: see :func:`plan_cpu_threads`.

    Returns:
        An entry for each stage that runs on CPU (:func:`runs_on_cpu`); other stages are absent.
        ``{}`` when fewer than two workers run on CPU (one worker keeps torch's and vLLM's
        defaults: vLLM's ``auto`` binding then keeps a core free for its scheduler process).
        The plan is logged once at INFO.
    """
    if worker_backend != "mp":
        return {}
    if cpu_host is None:
        cpu_host = current_platform.is_cpu()
    workers = [(s, i) for s in stages if runs_on_cpu(s, cpu_host) for i in range(s.replicas)]
    if len(workers) < 2:  # nothing to share: torch's and vLLM's own defaults, as inline
        return {}
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    ranks = [s.parallel_size()[0] if s.is_llm else 1 for s, _ in workers]
    plans = plan_cpu_threads(cores, ranks, user_env)
    out: dict[int, list[dict[str, str]]] = {}
    for (stage, _), plan in zip(workers, plans):
        out.setdefault(stage.stage_id, []).append(plan)
    labels = [f"{s.label} replica {i}" if s.replicas > 1 else s.label for s, i in workers]
    items = "; ".join(
        f"{label}: " + (" ".join(f"{k}={v}" for k, v in plan.items()) or "the user's settings")
        for label, plan in zip(labels, plans)
    )
    logger.info("CPU threads: %d core(s) for %d worker(s): %s", len(cores), len(plans), items)
    return out
