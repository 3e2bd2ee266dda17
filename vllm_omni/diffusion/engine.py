"""Diffusion engine: runs a text-to-image pipeline on one or several tensor-parallel ranks.

>>> engine = DiffusionEngine(OmniDiffusionConfig(model="/path/to/z-image"))
>>> [out] = engine.generate(["a cat"], OmniDiffusionSamplingParams(height=512, width=512, seed=0))
>>> out.images[0].save("cat.png")
>>> engine.shutdown()

``tensor_parallel_size == 1`` keeps the pipeline in this process (``engine.pipeline``);
larger sizes start one worker process per rank (gloo on CPU / NCCL on CUDA) and everything that
must touch the pipelines — LoRA loading included — goes through :meth:`DiffusionEngine.collective_rpc`.

A rank starts as an ``mp`` stage worker does (:mod:`vllm_omni.worker_start`): forked
from this process's preloaded fork server, which imported torch, vLLM and this module once, so a
rank pays no import (about 7 s of CPU per rank on a 2-core machine); it gets this process's
environment, stdout and stderr. A rank whose environment differs from the fork server's in a
variable an import may read is spawned as a fresh interpreter instead (the reason logged at DEBUG
by ``vllm_omni.worker_start``), and so is every rank with ``VLLM_OMNI_WORKER_START=spawn``.
CUDA is never initialised in the fork server: each rank selects ``cuda:<rank>`` itself, after the
fork (:class:`~vllm_omni.diffusion.worker.DiffusionWorker`). A rank watches its parent
(:mod:`vllm_omni.process_guard`): a forked rank's parent is the fork server, which exits when
this process does (SIGKILL included), so the ranks die with this process either way. The ranks speak the messages
and error convention of every worker of ours (:mod:`vllm_omni.ipc`): :class:`~vllm_omni.ipc.Ready`
or :class:`~vllm_omni.ipc.Failed` at start-up, :class:`~vllm_omni.ipc.Call` answered by
:class:`~vllm_omni.ipc.CallResult` (errors keep their class), :class:`~vllm_omni.ipc.Shutdown`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from vllm_omni import worker_start as start
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.worker import DiffusionWorker, worker_main
from vllm_omni.errors import ConfigError, StageDeadError, StageEngineError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.ipc import Call, CallResult, Failed, Ready, Shutdown, decoder, dump, encode, load, load_error
from vllm_omni.process_guard import join_exit, mark_owner, watch_parent

__all__ = ["DiffusionEngine", "DiffusionOutput"]

logger = logging.getLogger(__name__)

#: Seconds ``shutdown()`` gives the ranks to finish their call and exit when no timeout is given.
_WORKER_EXIT_S = 30.0
#: Seconds between SIGTERM and SIGKILL of a rank that did not exit in time.
_KILL_AFTER_S = 2.0

_from_rank = decoder(Ready | Failed | CallResult)


def _guarded_worker_main(*args) -> None:
    """A rank: :func:`worker_main` in a process that exits when its parent is gone (SIGKILL included)."""
    watch_parent()
    worker_main(*args)


def rank_process(
    od_config: OmniDiffusionConfig, rank: int, world: int, init_method: str, conn
) -> tuple[Any, str]:
    """The unstarted process of tensor-parallel rank ``rank`` (serving ``conn``) and how it starts,
    ``"forkserver"`` or ``"spawn"`` (:func:`vllm_omni.worker_start.process_for`; start it
    with :func:`~vllm_omni.worker_start.start_process`)."""
    return start.process_for(
        f"diffusion rank {rank}",
        _guarded_worker_main,
        (od_config, rank, world, init_method, conn),
        {},  # a rank runs with this process's environment
        name=f"vllm-omni-diffusion-tp{rank}",
        daemon=True,  # terminated at this process's exit, as before
    )


class DiffusionEngine:
    """Owns the diffusion workers of one stage.

    Args:
        od_config: validated engine settings; the pipeline is chosen by
            ``od_config.use_in_tree`` (in-tree when ``_class_name`` has one and the backend
            allows it, else ``diffusers.DiffusionPipeline``).

    Raises:
        ConfigError: ``od_config`` has no ``model``.
        StageEngineError: a worker failed to start (the worker's traceback is attached).
    """

    def __init__(self, od_config: OmniDiffusionConfig):
        if od_config.model is None:
            raise ConfigError("DiffusionEngine needs OmniDiffusionConfig.model (a diffusers directory)")
        self.od_config = od_config
        self._local: DiffusionWorker | None = None
        self._procs: list = []
        self._conns: list = []
        self._tmpdir: str | None = None
        self._closed = False
        self._cids = itertools.count()
        #: per rank, how its process started: ``"forkserver"`` or ``"spawn"`` (empty with one rank)
        self.start_methods: list[str] = []
        world = od_config.tensor_parallel_size
        if world == 1:
            self._local = DiffusionWorker(od_config)
            return
        init_method = od_config.distributed_init_method
        if init_method is None:
            self._tmpdir = tempfile.mkdtemp(prefix="vllm_omni_diffusion_")
            init_method = f"file://{os.path.join(self._tmpdir, 'pg')}"
        mark_owner()  # the ranks exit with this process, however it ends (process_guard)
        start.hold(self)  # released at shutdown: the last user of this process ends the fork server
        started = time.monotonic()
        try:
            for rank in range(world):
                parent, child = multiprocessing.Pipe()
                try:
                    proc, how = rank_process(od_config, rank, world, init_method, child)
                    start.start_process(proc, how, {})
                except BaseException:
                    parent.close()
                    raise
                finally:
                    child.close()
                self._procs.append(proc)
                self._conns.append(parent)
                self.start_methods.append(how)
            for rank, conn in enumerate(self._conns):
                msg = self._recv(rank, conn)
                if isinstance(msg, Failed):
                    raise StageEngineError(f"diffusion worker {rank} failed to start") from load_error(
                        msg.error
                    )
            kinds = {"forkserver": "forked preloaded", "spawn": "fresh interpreter"}
            logger.info(
                "diffusion: %d tensor-parallel ranks ready in %.1f s (%s)",
                world,
                time.monotonic() - started,
                ", ".join(sorted({kinds[h] for h in self.start_methods})),
            )
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ access
    @property
    def pipeline(self):
        """The in-process pipeline (``tensor_parallel_size == 1`` only).

        Raises:
            RuntimeError: with several ranks the pipelines live in worker processes; use
                :meth:`collective_rpc`.
        """
        if self._local is None:
            raise RuntimeError(
                "engine.pipeline is only available with tensor_parallel_size=1; "
                "use engine.collective_rpc(...) to reach the per-rank pipelines"
            )
        return self._local.pipeline

    @property
    def worker(self) -> DiffusionWorker:
        """The in-process worker (``tensor_parallel_size == 1`` only); raises ``RuntimeError`` otherwise."""
        if self._local is None:
            raise RuntimeError("engine.worker is only available with tensor_parallel_size=1")
        return self._local

    # ------------------------------------------------------------------ calls
    def _recv(self, rank: int, conn) -> Ready | Failed | CallResult:
        try:
            return _from_rank.decode(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            code = self._procs[rank].exitcode if rank < len(self._procs) else None
            raise StageDeadError(f"diffusion worker {rank} exited unexpectedly (exit code {code})") from exc

    def collective_rpc(self, method: str | Callable, *args, **kwargs) -> list[Any]:
        """Run ``method`` on every rank's :class:`DiffusionWorker` and return the per-rank results.

        ``method`` is a worker or pipeline method name, or a (module-level, picklable)
        callable invoked as ``method(worker, *args, **kwargs)``. Arguments and results
        cross process boundaries by pickling when ``tensor_parallel_size > 1``.

        Returns:
            ``[result_rank0, result_rank1, ...]``.

        Raises:
            The first worker exception (re-raised here, worker traceback in its notes),
            :class:`StageDeadError` when a worker process died, :class:`StageEngineError` when
            the engine is shut down.
        """
        if self._closed:
            raise StageEngineError("DiffusionEngine is shut down")
        if self._local is not None:
            return [self._local.execute_method(method, *args, **kwargs)]
        frame = encode(Call(next(self._cids), "", dump((method, args, kwargs))))
        for conn in self._conns:
            conn.send_bytes(frame)
        replies: list[CallResult] = []
        for rank, conn in enumerate(self._conns):
            reply = self._recv(rank, conn)
            if not isinstance(reply, CallResult):
                raise StageEngineError(f"diffusion worker {rank} answered a call with {type(reply).__name__}")
            replies.append(reply)
        for reply in replies:
            if not reply.ok:
                raise load_error(reply.payload)
        return [load(reply.payload) for reply in replies]

    def generate(
        self, prompts: list[str] | str, sampling_params: OmniDiffusionSamplingParams | None = None
    ) -> list[DiffusionOutput]:
        """Generate images for ``prompts`` (one batch through the denoiser).

        Args:
            prompts: texts; a single string is treated as one prompt.
            sampling_params: per-request settings (defaults: ``OmniDiffusionSamplingParams()``).

        Returns:
            One :class:`DiffusionOutput` per prompt, in order: ``images`` (PIL, ``W x H``) and,
            in-tree, float32 ``latents`` ``(num_images_per_prompt, C, H/8, W/8)``.

        Raises:
            ValueError: invalid sizes for the model (multiples of the VAE factor x patch size).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        sampling_params = sampling_params or OmniDiffusionSamplingParams()
        return self.collective_rpc("generate", list(prompts), sampling_params)[0]

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop worker processes (idempotent). The in-process pipeline is released.

        The ranks get ``timeout`` seconds (default 30) to finish their current call and exit;
        the ones still alive then get SIGTERM, and SIGKILL :data:`_KILL_AFTER_S` seconds later.
        """
        if self._closed:
            return
        self._closed = True
        self._local = None
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send_bytes(encode(Shutdown(timeout)))
        deadline = time.monotonic() + (_WORKER_EXIT_S if timeout is None else timeout)
        for proc in self._procs:
            join_exit(proc, deadline - time.monotonic())
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        kill_at = time.monotonic() + _KILL_AFTER_S
        for proc in self._procs:
            proc.join(timeout=max(0.0, kill_at - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        start.release(self)

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:  # noqa: SIM105 (contextlib may already be gone at interpreter exit)
            self.shutdown()
        except Exception:
            pass
