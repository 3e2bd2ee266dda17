"""Where each replica of a stage runs: its device group and the environment of its worker.

A stage's ``devices`` (checked by the stage config, see ``vllm_omni.config.placement``) are
split in order into one group per replica, each of the stage's parallel size. A process
worker is spawned with :func:`worker_env` in its environment (``WorkerStageRuntime``), so it
sees only its own devices, renumbered from
``cuda:0``; with ``"cpu"`` it sees no CUDA device at all. Inline replicas share the caller's
process: nothing is applied there, and the caller's environment is never changed.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module is imported by workers before torch: keep it light
    from vllm_omni.config.stage_config import BaseVllmOmniStageConfig

logger = logging.getLogger(__name__)

#: The variable that limits the CUDA devices a worker process sees.
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def device_groups(stage: BaseVllmOmniStageConfig) -> list[list[str]]:
    """The devices of each replica of ``stage``, in replica order.

    Returns:
        ``[]`` when the stage sets no ``devices``; ``[["cpu"]] * replicas`` for ``"cpu"``;
        otherwise ``replicas`` lists of ``parallel size`` names each, e.g.
        ``[["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]`` for TP 2 x 2 replicas.
    """
    devices = stage.devices
    if not devices:
        return []
    if devices == ["cpu"]:
        return [["cpu"] for _ in range(stage.replicas)]
    size = len(devices) // stage.replicas  # the stage config checked len == parallel size x replicas
    return [devices[i * size : (i + 1) * size] for i in range(stage.replicas)]


def worker_env(stage: BaseVllmOmniStageConfig, replica_index: int) -> dict[str, str]:
    """Environment variables of the worker of replica ``replica_index`` of ``stage``.

    Returns:
        ``{}`` when the stage sets no ``devices``; ``{"CUDA_VISIBLE_DEVICES": ""}`` for
        ``"cpu"``; else ``{"CUDA_VISIBLE_DEVICES": "2,3"}`` (that replica's CUDA indices).

    Raises:
        IndexError: ``replica_index`` is not in ``range(stage.replicas)``.
    """
    if not 0 <= replica_index < stage.replicas:
        raise IndexError(f"{stage.label} has {stage.replicas} replica(s); no replica {replica_index}")
    groups = device_groups(stage)
    if not groups:
        return {}
    group = groups[replica_index]
    indices = [] if group == ["cpu"] else [name.split(":", 1)[1] for name in group]
    return {VISIBLE_DEVICES: ",".join(indices)}


def apply_worker_env(env: dict[str, str]) -> None:
    """Set ``env`` in this (worker) process; call it before torch or vLLM is imported.

    CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when it initialises; a worker that imported torch
    before this call may already see every device, so that case is logged.
    """
    if env and "torch" in sys.modules:
        logger.warning("worker environment %s applied after torch was imported; CUDA may ignore it", env)
    os.environ.update(env)
