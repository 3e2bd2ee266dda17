"""Diffusion worker: one per tensor-parallel rank, owning one pipeline instance.

With ``tensor_parallel_size == 1`` the engine keeps a worker in its own process; with
more ranks every rank (rank 0 included) runs :func:`worker_main` in a process of its own
(forked from the preloaded worker fork server, or spawned: :mod:`vllm_omni.diffusion.engine`)
and talks to the engine through a pipe. Every rank builds the full pipeline (text
encoder, VAE and scheduler are replicated, the denoiser is sharded) and executes the
same calls on the same inputs, so the all-reduces inside the denoiser line up and all
ranks hold identical latents; only rank 0 returns generation results.

LoRA: after the pipeline is loaded the worker builds its :class:`WorkerLoRA` (distill fuse,
LoRA manager, pinned start-up adapters) and serves ``add_lora`` / ``remove_lora`` /
``list_loras`` / ``pin_lora``; :meth:`DiffusionWorker.generate_batch` runs prompts that each
carry their own adapter set in one denoiser batch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from vllm_omni.diffusion.compile import RegionalCompiler, default_cache_dir, stage_cache_key
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
from vllm_omni.diffusion.forward_context import time_denoising_steps
from vllm_omni.diffusion.pipelines import build_pipeline
from vllm_omni.diffusion.pipelines.base import DiffusionPipeline
from vllm_omni.diffusion.worker_lora import LoRASet, WorkerLoRA
from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.ipc import (
    Call,
    CallResult,
    Failed,
    Ready,
    Shutdown,
    decoder,
    dump,
    dump_error,
    encode,
    load,
    load_error,
)
from vllm_omni.lora.request import NO_ADAPTERS, LoRARequest, RequestAdapters
from vllm_omni.platform import keep_freed_cpu_memory, request_amx_permission

logger = logging.getLogger(__name__)
_to_rank = decoder(Call | Shutdown)


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
        request_amx_permission()  # this process may run AMX kernels (bf16 on AVX-512/AMX CPUs)
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
            keep_freed_cpu_memory()  # activations reuse heap pages instead of faulting them in per step
        if od_config.use_in_tree:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            init_diffusion_parallel_state(world_size, rank, distributed_init_method, backend)

        self.pipeline: DiffusionPipeline = build_pipeline(od_config, device=self.device)
        self.lora = WorkerLoRA(self.pipeline, od_config)
        #: one :class:`RegionalCompiler` per compiled denoiser (empty when the stage runs eagerly)
        self.compilers = [
            c for m in self.lora.managers.values() for c in compile_denoisers(m, od_config, rank, world_size)
        ]
        #: ``(graphs, seconds)`` of the start-up warm-up of a compiled stage (``None``: none ran)
        self.warm_up: tuple[int, float] | None = None
        if self.compilers and od_config.compile_warm_up:
            started = time.monotonic()
            graphs = self.warm_up_compiled()
            self.warm_up = (graphs, time.monotonic() - started)

    def warm_up_compiled(self, height: int = 64, width: int = 64, steps: int = 1) -> int:
        """Compile every graph variant of the compiled denoisers now; returns how many were created
        (``0`` when the stage runs eagerly). See :func:`vllm_omni.diffusion.compile_warmup.warm_up_compiled`."""
        from vllm_omni.diffusion.compile_warmup import warm_up_compiled

        return warm_up_compiled(self, height=height, width=width, steps=steps)

    def generate(
        self, prompts: list[str], sampling_params: OmniDiffusionSamplingParams
    ) -> list[DiffusionOutput] | None:
        """Run the pipeline with ``sampling_params.lora_requests`` for every prompt.

        Returns the outputs on rank 0 and ``None`` on other ranks; raises the first failure.
        """
        adapters = RequestAdapters(sampling_params.adapters)
        results = self.generate_batch(prompts, sampling_params, [adapters] * len(prompts))
        if results is None:
            return None
        outputs: list[DiffusionOutput] = []
        for res in results:
            if isinstance(res, BaseException):
                raise res
            outputs.append(res)
        return outputs

    def generate_batch(
        self,
        prompts: list[str],
        sampling_params: OmniDiffusionSamplingParams,
        lora_sets: list[LoRASet] | None = None,
        seeds: list[int | None] | None = None,
    ) -> list[DiffusionOutput | BaseException] | None:
        """Run several requests in one pipeline call, each prompt with its own adapters.

        Args:
            prompts: one prompt per request.
            sampling_params: the settings the requests share; ``negative_prompt`` may be a list
                (one per prompt); its ``lora_requests`` are ignored here.
            lora_sets: per prompt its :class:`~vllm_omni.lora.request.RequestAdapters`; a
                ``None`` scale takes the default (start-up ``lora_scale`` or 1.0).
            seeds: per prompt seed (``None``: ``sampling_params.seed``).

        Returns:
            On rank 0, per prompt a :class:`DiffusionOutput` or the exception that kept that
            prompt out of the batch (its adapter failed to load: caches unchanged); ``None``
            on other ranks. Errors of the pipeline call itself are raised.
        """
        lora_sets = lora_sets or [NO_ADAPTERS] * len(prompts)
        if len(lora_sets) != len(prompts) or (seeds is not None and len(seeds) != len(prompts)):
            raise ValueError("generate_batch needs one lora set (and seed) per prompt")
        results: list[Any] = [None] * len(prompts)
        held: list[list[tuple[str, list[int]]]] = []  # per kept prompt: (denoiser, slot ids) held
        keep: list[int] = []
        try:
            for i, adapters in enumerate(lora_sets):
                try:
                    held.append(self.lora.acquire(adapters))
                    keep.append(i)
                except Exception as exc:  # this request only: its adapter cannot be served
                    results[i] = _picklable_error(exc) if self.world_size > 1 else exc
            if keep:
                sp = sampling_params
                if isinstance(sp.negative_prompt, list | tuple):
                    if len(sp.negative_prompt) != len(prompts):
                        raise InvalidRequestError(
                            f"negative_prompt has {len(sp.negative_prompt)} entries for {len(prompts)} prompts"
                        )
                    sp = dataclasses.replace(sp, negative_prompt=[sp.negative_prompt[i] for i in keep])
                self.lora.note_batch([lora_sets[i] for i in keep])
                with time_denoising_steps() as step_times:
                    outputs = self.pipeline.generate(
                        [prompts[i] for i in keep],
                        sp,
                        seeds=None if seeds is None else [seeds[i] for i in keep],
                        lora_context=self.lora.context_factory([lora_sets[i] for i in keep]),
                    )
                self.lora.note_steps(step_times)
                for i, out in zip(keep, outputs, strict=True):
                    results[i] = out
        finally:
            for ids in held:
                self.lora.release(ids)
        return results if self.rank == 0 else None

    # ------------------------------------------------------------------ LoRA management
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into this rank's host cache (``True`` if newly loaded)."""
        return self.lora.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter (``False`` if not cached; ``LoRACacheError`` while a request holds it)."""
        return self.lora.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        """Cached adapter ids, least recently used first."""
        return self.lora.list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        """Never evict this cached adapter (``ValueError`` when not cached)."""
        return self.lora.pin_lora(lora_int_id)

    def stats_events(self) -> list[tuple[str, str, float]]:
        """This rank's statistics events since the last call (:meth:`WorkerLoRA.drain_events`)."""
        return self.lora.drain_events()

    def describe(self) -> dict[str, Any]:
        """``{"rank", "world_size", "device", "pipeline", "denoiser", "size_factor", "max_size",
        "mixed_lora_batch", "lora_layers", "startup_loras", "output_kind", "accepts_image",
        "image_optional", "denoisers", "warm_up"}`` (class names, device as str; sizes must be multiples of
        ``size_factor``; ``max_size``: the pipeline's largest ``(height, width)``, ``None`` when it does
        not declare one; ``output_kind``: ``"image"`` or ``"video"``; ``accepts_image``: whether a request may
        carry an input image; ``image_optional``: whether such a pipeline also runs without one (its
        ``requires_image`` is false: Wan2.2 TI2V-5B text- and image-to-video); ``denoisers``: the
        pipeline attributes adapters bind to; ``warm_up``: ``(graphs, seconds)`` of a compiled stage's
        start-up warm-up, ``None`` when none ran)."""
        denoiser = self.pipeline.transformer
        max_size = getattr(self.pipeline, "max_image_size", None)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "device": str(self.device),
            "pipeline": type(self.pipeline).__name__,
            "denoiser": type(denoiser).__name__ if denoiser is not None else None,
            "size_factor": int(self.pipeline.vae_scale_factor) * 2,
            "max_size": None if max_size is None else tuple(int(v) for v in max_size),
            "mixed_lora_batch": self.pipeline.mixed_lora_batch,
            "lora_layers": sum(len(m.wrappers) for m in self.lora.managers.values()),
            "startup_loras": [r.lora_int_id for r in self.lora.startup_requests],
            "output_kind": getattr(self.pipeline, "output_kind", "image"),
            "accepts_image": bool(getattr(self.pipeline, "accepts_image", False)),
            "image_optional": not getattr(self.pipeline, "requires_image", True),
            "denoisers": list(self.lora.denoisers),
            "warm_up": self.warm_up,
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


def compile_denoisers(manager, od_config: OmniDiffusionConfig, rank: int, world_size: int) -> list:
    """Compile the repeated blocks of every denoiser ``manager`` patched, when ``od_config.compiles``.

    The LoRA manager was built with banks (``WorkerLoRA``), so the compiled blocks read them; the
    compile cache lives in ``od_config.compile_cache_dir`` or a directory keyed by model, dtype, TP
    layout and torch version under the user cache. A denoiser without a repeated block list (some
    diffusers models) stays eager, with a warning.
    """
    if not od_config.compiles:
        return []
    key = stage_cache_key(od_config.model, od_config.torch_dtype(), rank, world_size, torch.__version__)
    cache_dir = od_config.compile_cache_dir or default_cache_dir(key)
    banks = manager.banks
    compilers = []
    for name, denoiser in manager.denoisers.items():
        label = f"diffusion {type(denoiser).__name__}{'.' + name if name else ''} (rank {rank})"
        try:
            compilers.append(
                RegionalCompiler(
                    denoiser,
                    cache_dir=cache_dir,
                    backend=od_config.compile_backend,
                    before_call=manager.sync_step,
                    check_rows=None if banks is None else banks.check_rows,
                    variant=lambda: "lora" if manager.lora_on else "base",
                    label=label,
                )
            )
        except ValueError as exc:
            logger.warning("%s: runs eagerly: %s", label, exc)
    return compilers


def _picklable_error(exc: BaseException) -> BaseException:
    """``exc`` as it crosses to the engine (:func:`vllm_omni.ipc.dump_error`: its class kept,
    the rank's traceback attached as a note)."""
    return load_error(dump_error(exc, "diffusion worker"))


def worker_main(od_config: OmniDiffusionConfig, rank: int, world_size: int, init_method: str, conn) -> None:
    """Entry point of a TP worker process (forked from the worker fork server, or spawned).

    Messages on ``conn`` (:mod:`vllm_omni.ipc`, one frame each): after start-up the worker sends
    :class:`~vllm_omni.ipc.Ready` or :class:`~vllm_omni.ipc.Failed` (``rid`` -1, the start-up
    error); then every :class:`~vllm_omni.ipc.Call` (payload: pickled ``(method, args, kwargs)``)
    is answered by a :class:`~vllm_omni.ipc.CallResult`; :class:`~vllm_omni.ipc.Shutdown` or the
    end of the pipe ends the loop.
    """
    if od_config.resolved_device() == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        worker = DiffusionWorker(od_config, rank, world_size, init_method)
    except BaseException as exc:  # report start-up failures instead of hanging the engine
        conn.send_bytes(encode(Failed(-1, dump_error(exc, f"diffusion worker {rank}"))))
        return
    conn.send_bytes(encode(Ready(os.getpid(), torch.get_num_threads())))
    while True:
        try:
            msg = _to_rank.decode(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if isinstance(msg, Shutdown):
            break
        try:
            method, args, kwargs = load(msg.payload)
            reply = CallResult(msg.cid, True, dump(worker.execute_method(method, *args, **kwargs)))
        except BaseException as exc:
            reply = CallResult(msg.cid, False, dump_error(exc, f"diffusion worker {rank}"))
        conn.send_bytes(encode(reply))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
