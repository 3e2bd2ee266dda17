"""Stage workers: each stage's runtime in a process of its own (``worker_backend``).

- :mod:`~vllm_omni.engine.workers.protocol`: the typed messages between the orchestrator's
  process and a worker (msgspec structs; Python payloads pickled with torch's
  ``ForkingPickler``, so CPU tensors cross through shared memory).
- :mod:`~vllm_omni.engine.workers.mp`: the worker process (the ordinary inline runtime).
- :mod:`~vllm_omni.engine.workers.client`: :class:`WorkerStageRuntime`, the
  :class:`~vllm_omni.engine.protocols.StageRuntime` of the ``mp`` backend (restart on death).
- :mod:`~vllm_omni.engine.workers.lora_journal`: adapters and pins replayed into a restarted worker.
"""

from __future__ import annotations

from vllm_omni.config.omni_config import WORKER_BACKENDS

__all__ = ["WORKER_BACKENDS"]
