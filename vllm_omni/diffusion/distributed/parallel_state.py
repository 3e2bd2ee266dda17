"""Process-group set-up for diffusion workers that use vLLM's parallel linear layers.

vLLM's ``*ParallelLinear`` layers read the tensor-parallel group from
``vllm.distributed.parallel_state`` and need a current ``VllmConfig`` while they are
constructed. A diffusion worker therefore initialises vLLM's distributed state once
(gloo on CPU, NCCL on CUDA) before it builds a denoiser, and every layer then shards
itself exactly as it would inside a vLLM LLM engine.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state as vllm_ps

from vllm_omni.errors import ConfigError

_VLLM_CONFIG: VllmConfig | None = None


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_diffusion_parallel_state(
    world_size: int = 1,
    rank: int = 0,
    distributed_init_method: str | None = None,
    backend: str | None = None,
) -> VllmConfig:
    """Initialise vLLM's world and tensor-parallel groups for a diffusion worker.

    Args:
        world_size: number of tensor-parallel ranks (diffusion stages use TP only).
        rank: this process's rank in ``[0, world_size)``.
        distributed_init_method: torch.distributed init URL (``file://`` or ``tcp://``);
            a fresh temporary file is used when ``None`` and ``world_size == 1``.
        backend: ``"gloo"`` or ``"nccl"``; defaults to :func:`default_backend`.

    Returns:
        The ``VllmConfig`` that is made current for layer construction.

    Idempotent within a process: a second call with the same world size is a no-op.

    Raises:
        ValueError: when ``world_size > 1`` without an init method, or when the process
            already belongs to a group of a different size.
    """
    global _VLLM_CONFIG
    if vllm_ps.model_parallel_is_initialized():
        current = vllm_ps.get_tp_group().world_size
        if current != world_size:
            raise ConfigError(
                f"this process already runs tensor-parallel size {current}; cannot re-initialise with {world_size}"
            )
        return _VLLM_CONFIG or VllmConfig()
    if distributed_init_method is None:
        if world_size != 1:
            raise ValueError("distributed_init_method is required when world_size > 1")
        fd, path = tempfile.mkstemp(prefix="vllm_omni_pg_")
        os.close(fd)
        os.unlink(path)
        distributed_init_method = f"file://{path}"
    # vLLM's CPU communicator names its shared-memory segments after VLLM_DIST_IDENT; derive
    # it from the (shared) init method so every rank agrees and two process groups never
    # collide (a fixed or inherited name made concurrent/consecutive TP groups fail with
    # "create shm in SHMManager failed. errno: 17").
    # The variable is read only while the groups are created; it is restored afterwards so that
    # processes started later (LLM stage workers, servers) do not inherit it: vLLM warns about any
    # VLLM_* variable it does not know, and this one is not in vllm.envs.
    digest = hashlib.sha1(distributed_init_method.encode()).hexdigest()[:16]
    previous = os.environ.get("VLLM_DIST_IDENT")
    os.environ["VLLM_DIST_IDENT"] = f"omni-diffusion-{digest}"
    _VLLM_CONFIG = VllmConfig()
    try:
        with set_current_vllm_config(_VLLM_CONFIG):
            vllm_ps.init_distributed_environment(
                world_size=world_size,
                rank=rank,
                distributed_init_method=distributed_init_method,
                local_rank=rank,
                backend=backend or default_backend(),
            )
            vllm_ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    finally:
        if previous is None:
            os.environ.pop("VLLM_DIST_IDENT", None)
        else:
            os.environ["VLLM_DIST_IDENT"] = previous
    return _VLLM_CONFIG


def current_vllm_config_for_layers():
    """Context manager making the diffusion worker's ``VllmConfig`` current (for layer construction)."""
    return set_current_vllm_config(_VLLM_CONFIG or VllmConfig())


def get_tp_rank_and_size() -> tuple[int, int]:
    """(rank, world size) of the tensor-parallel group; (0, 1) before initialisation."""
    if not vllm_ps.model_parallel_is_initialized():
        return 0, 1
    group = vllm_ps.get_tp_group()
    return group.rank_in_group, group.world_size
