"""Stage workers: each stage's runtime in a process of its own (``worker_backend``).

- :mod:`~vllm_omni.engine.workers.supervisor`: :class:`SupervisedStageRuntime`, what both
  transports share (health, the stage's restart policy, adapter replay that restores what it
  can, in-flight failures, reaping every worker started).
- :mod:`~vllm_omni.engine.workers.protocol`: the typed messages between the orchestrator's
  process and a worker (msgspec structs on top of :mod:`vllm_omni.ipc`; Python payloads pickled
  with torch's ``ForkingPickler``, so CPU tensors cross through shared memory).
- :mod:`~vllm_omni.engine.workers.mp`: the worker process (the ordinary inline runtime).
- :mod:`~vllm_omni.engine.workers.client`: :class:`WorkerStageRuntime`, the
  :class:`~vllm_omni.engine.protocols.StageRuntime` of the ``mp`` backend (the pipe transport).
- :mod:`~vllm_omni.engine.workers.ray_backend`: ``RayStageRuntime`` (the Ray transport).
- :mod:`~vllm_omni.engine.workers.lora_journal`: adapters and pins replayed into a restarted worker.
- :mod:`~vllm_omni.worker_start`: how ``mp`` workers start (forked from a preloaded
  interpreter, or spawned); imports neither torch nor vLLM, so the command line can start the
  preloaded interpreter before its own imports (this package's ``WORKER_BACKENDS`` is lazy for that).
"""

from __future__ import annotations

from typing import Any

__all__ = ["WORKER_BACKENDS"]


def __getattr__(name: str) -> Any:
    if name == "WORKER_BACKENDS":  # imports vLLM (the config module): on first use only
        from vllm_omni.config.omni_config import WORKER_BACKENDS

        return WORKER_BACKENDS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
