"""What runs inside a stage's Ray actor: the ordinary inline stage runtime, served to the driver.

The actor is an asyncio actor (many calls in flight, no thread per call): a request is
queued by :meth:`StageActor.enqueue` (the driver waits for it, so checks raise at once and
requests queued inside a ``hold()`` block are queued before it ends) and collected by
:meth:`StageActor.result`, or, when streaming, by the generator :meth:`StageActor.stream`.
Calls that block on the stage's driver thread (LoRA management, shutdown) run in a thread.

Errors raised by the runtime are returned as :class:`~vllm_omni.ipc.RemoteFailure` values
(:func:`vllm_omni.ipc.dump_error`: their class and message), the convention every worker of
ours uses; the driver raises them with :func:`vllm_omni.ipc.unwrap`.

Outputs cross the object store with their CPU tensors as numpy arrays (cheaper than torch
tensors: measured ~1.3 ms per 10 MB call): :func:`to_wire` on the actor, :func:`from_wire`
on the driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from typing import Any

import torch

from vllm_omni.engine.inline_runtime import RuntimeFactory, make_inline_runtime, worker_process_defaults
from vllm_omni.ipc import RemoteFailure


@dataclasses.dataclass
class TorchAsNumpy:
    """A CPU torch tensor carried as a numpy array (``array``) between processes."""

    array: Any


def _tensor_to_wire(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        try:
            return TorchAsNumpy(value.detach().numpy())
        except TypeError:  # a dtype numpy has no counterpart for (bf16): sent as a tensor
            return value
    return value


def to_wire(output: Any) -> Any:
    """A stage output with its CPU tensor fields (``latents``, ``array``) as :class:`TorchAsNumpy`."""
    if not dataclasses.is_dataclass(output) or isinstance(output, type):
        return output
    changes = {
        f.name: _tensor_to_wire(getattr(output, f.name))
        for f in dataclasses.fields(output)
        if f.name in ("latents", "array")
    }
    return dataclasses.replace(output, **changes) if changes else output


def from_wire(output: Any) -> Any:
    """The inverse of :func:`to_wire` (the tensors share the received arrays' memory)."""
    if not dataclasses.is_dataclass(output) or isinstance(output, type):
        return output

    changes = {
        # the received arrays are read-only views of the object store: the tensors get their own copy
        f.name: torch.from_numpy(value.array if value.array.flags.writeable else value.array.copy())
        for f in dataclasses.fields(output)
        if isinstance(value := getattr(output, f.name), TorchAsNumpy)
    }
    return dataclasses.replace(output, **changes) if changes else output


class StageActor:
    """One stage's runtime (``make_inline_runtime``) inside a Ray actor.

    Args:
        stage: the resolved stage config.
        threads_from_driver: whether the driver set ``OMP_NUM_THREADS`` (forwarded to the
            actor); otherwise torch gets every core this process may use.
        config: the whole pipeline config, for the stage runtimes that read it.
        factory: the stage's registered runtime factory (``inline_runtime.runtime_factory``), passed
            from the driver (this process may not have imported the package that registered it).
    """

    def __init__(
        self, stage: Any, threads_from_driver: bool, config: Any = None, factory: RuntimeFactory | None = None
    ):
        if not threads_from_driver:
            # Ray sets OMP_NUM_THREADS to the actor's CPU resource (1) when the driver set none;
            # the stage gets the cores this process may use, as the inline runtime does
            cores = len(os.sched_getaffinity(0))
            os.environ["OMP_NUM_THREADS"] = str(cores)
            torch.set_num_threads(cores)
        worker_process_defaults()
        self.stage = stage
        self._futures: dict[str, Any] = {}
        self._holds: dict[int, contextlib.ExitStack] = {}
        try:
            self.runtime = make_inline_runtime(stage, config, factory)
            self._start_error: RemoteFailure | None = None
        except Exception as exc:  # answered by info(), with its class
            self.runtime = None
            self._start_error = RemoteFailure.of(exc, f"{stage.label} Ray actor")

    def info(self) -> dict[str, Any]:
        """Where the actor runs: ``node_id``, ``pid``, ``accelerator_ids`` (Ray's grant),
        ``cuda_visible_devices``, ``torch_threads``."""
        import ray  # the optional extra: this module is also imported where Ray is not installed

        if self._start_error is not None:
            return self._start_error
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "accelerator_ids": ctx.get_accelerator_ids(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "torch_threads": torch.get_num_threads(),
        }

    async def enqueue(self, request_id: str, request: Any, stream: bool):
        """Queue one :class:`~vllm_omni.inputs.stage_request.StageRequest` in the stage runtime (its
        checks raise here); ``stream``: keep its DELTA pieces."""
        if stream:
            pieces: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            request = dataclasses.replace(
                request, on_partial=lambda delta: loop.call_soon_threadsafe(pieces.put_nowait, delta)
            )
        else:
            pieces = None
        try:
            future = self.runtime.submit(request)
        except Exception as exc:
            return RemoteFailure.of(exc)
        self._futures[request_id] = (future, pieces)
        return None

    async def result(self, request_id: str) -> Any:
        """The output of a queued request (``None`` when it was cancelled)."""
        future, _ = self._futures[request_id]
        try:
            return to_wire(await asyncio.wrap_future(future))
        except asyncio.CancelledError:
            return None
        except Exception as exc:
            return RemoteFailure.of(exc)
        finally:
            self._futures.pop(request_id, None)

    async def stream(self, request_id: str):
        """Yield ``("partial", delta)`` for each piece of a streaming request, then ``("done", output)``."""
        future, pieces = self._futures[request_id]
        waiter = asyncio.ensure_future(asyncio.wrap_future(future))
        try:
            while True:
                getter = asyncio.ensure_future(pieces.get())
                await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield ("partial", getter.result())
                    continue
                getter.cancel()
                while not pieces.empty():
                    yield ("partial", pieces.get_nowait())
                try:
                    yield ("done", to_wire(waiter.result()))
                except Exception as exc:
                    yield ("done", RemoteFailure.of(exc))
                return
        finally:
            self._futures.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """Cancel a request (an LLM stage aborts it at its next step)."""
        entry = self._futures.get(request_id)
        if entry is not None:
            entry[0].cancel()

    async def validate_request(self, request: Any) -> None:
        return await self.call("validate_request", request)

    def hold_enter(self, token: int) -> Any:
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self.runtime.hold())
        except Exception as exc:
            return RemoteFailure.of(exc)
        self._holds[token] = stack
        return None

    def hold_exit(self, token: int) -> None:
        stack = self._holds.pop(token, None)
        if stack is not None:
            stack.close()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A runtime call (LoRA management, checks), run off the actor's event loop; its error as a ``RemoteFailure``."""
        try:
            return await asyncio.to_thread(getattr(self.runtime, method), *args, **kwargs)
        except Exception as exc:
            return RemoteFailure.of(exc)

    async def shutdown(self, timeout: float | None) -> None:
        if self.runtime is not None:
            await asyncio.to_thread(self.runtime.shutdown, timeout)
