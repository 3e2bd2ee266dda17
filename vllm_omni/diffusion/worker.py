"""Diffusion worker: one per tensor-parallel rank, owning one pipeline instance.

With ``tensor_parallel_size == 1`` the engine keeps a worker in its own process; with
more ranks every rank (rank 0 included) runs :func:`worker_main` in a spawned process
and talks to the engine through a pipe. Every rank builds the full pipeline (text
encoder, VAE and scheduler are replicated, the denoiser is sharded) and executes the
same calls on the same inputs, so the all-reduces inside the denoiser line up and all
ranks hold identical latents; only rank 0 returns generation results.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


class DiffusionWorker:
    """Holds ``pipeline`` for one rank.

    Args:
        od_config: the engine config.
        rank, world_size: tensor-parallel position.
        distributed_init_method: torch.distributed URL shared by all ranks (required for
            ``world_size > 1``).

    Attributes:
        pipeline: the in-tree pipeline or the diffusers fallback; ``pipeline.transformer``
            is the denoiser module to patch.
        device: this rank's device (``cuda:<rank>`` with CUDA and TP).
    """

    def __init__(
        self,
        od_config: OmniDiffusionConfig,
        rank: int = 0,
        world_size: int = 1,
        distributed_init_method: str | None = None,
    ):
        self.od_config = od_config
        self.rank = rank
        self.world_size = world_size
        device = od_config.resolved_device()
        if device.startswith("cuda"):
            index = rank if world_size > 1 or device == "cuda" else torch.device(device).index or 0
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        else:
            self.device = torch.device("cpu")
        if od_config.use_in_tree:
            from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            init_diffusion_parallel_state(world_size, rank, distributed_init_method, backend)
        from vllm_omni.diffusion.pipelines import build_pipeline

        self.pipeline = build_pipeline(od_config, device=self.device)

    def generate(
        self, prompts: list[str], sampling_params: OmniDiffusionSamplingParams
    ) -> list[DiffusionOutput] | None:
        """Run the pipeline; returns the outputs on rank 0 and ``None`` on other ranks."""
        outputs = self.pipeline.generate(prompts, sampling_params)
        return outputs if self.rank == 0 else None

    def describe(self) -> dict[str, Any]:
        """``{"rank", "world_size", "device", "pipeline", "denoiser"}`` (class names, device as str)."""
        denoiser = getattr(self.pipeline, "transformer", None)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "device": str(self.device),
            "pipeline": type(self.pipeline).__name__,
            "denoiser": type(denoiser).__name__ if denoiser is not None else None,
        }

    def execute_method(self, method: str | Callable, *args, **kwargs) -> Any:
        """Call ``method`` on this worker.

        ``method`` is a callable (invoked as ``method(worker, *args, **kwargs)``; must be
        picklable, i.e. a module-level function, for multi-process engines) or the name of
        a method of the worker or, failing that, of its pipeline.

        Raises:
            AttributeError: when neither the worker nor the pipeline has ``method``.
        """
        if callable(method):
            return method(self, *args, **kwargs)
        target = getattr(self, method, None)
        if target is None:
            target = getattr(self.pipeline, method, None)
        if target is None:
            raise AttributeError(
                f"neither DiffusionWorker nor {type(self.pipeline).__name__} has method {method!r}"
            )
        return target(*args, **kwargs)


def _picklable_error(exc: BaseException) -> BaseException:
    import pickle

    text = "".join(traceback.format_exception(exc))
    try:
        pickle.dumps(exc)
    except Exception:
        return RuntimeError(text)
    exc.add_note(f"raised in diffusion worker:\n{text}")
    return exc


def worker_main(od_config: OmniDiffusionConfig, rank: int, world_size: int, init_method: str, conn) -> None:
    """Entry point of a spawned TP worker process.

    Protocol on ``conn``: after start-up the worker sends ``("ready", None)`` or
    ``("error", exception)``; then for every ``(method, args, kwargs)`` it receives it
    replies ``("ok", result)`` or ``("error", exception)``; ``None`` ends the loop.
    """
    if od_config.resolved_device() == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        worker = DiffusionWorker(od_config, rank, world_size, init_method)
    except BaseException as exc:  # report start-up failures instead of hanging the engine
        conn.send(("error", _picklable_error(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        method, args, kwargs = msg
        try:
            conn.send(("ok", worker.execute_method(method, *args, **kwargs)))
        except BaseException as exc:
            conn.send(("error", _picklable_error(exc)))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
