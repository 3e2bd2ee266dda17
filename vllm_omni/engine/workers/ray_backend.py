"""``worker_backend="ray"``: each stage runs in its own Ray actor, placed by resources.

:class:`RayStageRuntime` implements the :class:`~vllm_omni.engine.protocols.StageRuntime`
contract in the caller's process; its actor (:class:`~vllm_omni.engine.workers.ray_actor.StageActor`)
builds the ordinary inline runtime of the stage (``make_inline_runtime``), so batching, LoRA
and streaming behave as with the inline backend. Outputs travel through Ray's object store
(CPU tensors as numpy arrays).

Cluster. The first runtime connects (``address``, else ``RAY_ADDRESS``, else a new local
cluster without dashboard, never one found on the machine; ``RAY_AUTH_MODE=disabled`` unless set); a local cluster started
here is shut down when the last runtime shuts down. A driver that is already connected
(``ray.init`` called before) keeps its connection.

Placement. Each stage gets a one-bundle placement group: ``{"CPU": 1}`` plus the stage's
``ray_resources`` (e.g. ``{"node_a": 1}``: custom resources a node was started with) and,
unless ``ray_resources`` names ``"GPU"``, one GPU per ``cuda`` entry of the stage's
``devices`` or, on a cluster with GPUs, per tensor-parallel rank. Ray sets
``CUDA_VISIBLE_DEVICES`` of the actor for GPUs it grants; custom resources set no device
variable.

Failures. Supervision (health, the stage's restart policy, adapter replay, in-flight failures,
stopping every actor started) is :class:`~vllm_omni.engine.workers.supervisor.SupervisedStageRuntime`'s;
this module only moves messages. A dead actor (killed, crashed, its node removed) is seen by
the next call on it (``RayActorError``); errors raised in the actor cross as
:class:`~vllm_omni.ipc.RemoteFailure` values, with their class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from vllm_omni.engine.workers.ray_actor import StageActor, from_wire
from vllm_omni.engine.workers.supervisor import Pending, SupervisedStageRuntime
from vllm_omni.errors import StageDeadError, StageEngineError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.ipc import unwrap

logger = logging.getLogger(__name__)

#: Seconds a stage waits for its placement group before failing with ``StageEngineError``.
PLACEMENT_TIMEOUT_S = 120.0
#: Seconds ``shutdown()`` gives the actor's runtime when no timeout is given.
SHUTDOWN_S = 60.0
#: Environment variables the driver hands its actors (a remote node does not inherit them).
_FORWARDED_ENV_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "OMP_", "MKL_")

_cluster_lock = threading.Lock()
_cluster = {"users": 0, "owned": False}


def connect(address: str | None = None) -> None:
    """Connect this process to Ray once per user (see the module docstring); count the user."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray  # the optional `ray` extra: imported on use (stage_factory imports this module)

    with _cluster_lock:
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS") or None
            # no address: a new local cluster, no dashboard. ``address="local"`` because Ray's own
            # default attaches to the latest cluster started on this machine (``ray start``, another
            # program's), whose resources and lifetime are not this pipeline's.
            ray.init(
                **({"address": address} if address else {"address": "local", "include_dashboard": False})
            )
            _cluster["owned"] = address is None
        _cluster["users"] += 1


def disconnect() -> None:
    """Drop one user; the last one shuts down a local cluster started by :func:`connect`."""
    import ray  # the optional `ray` extra: imported on use (stage_factory imports this module)

    with _cluster_lock:
        _cluster["users"] = max(0, _cluster["users"] - 1)
        if _cluster["users"] == 0 and _cluster["owned"]:
            _cluster["owned"] = False
            ray.shutdown()


def _stage_gpus(stage: Any, cluster_has_gpus: bool) -> int:
    devices = stage.options.get("devices") or getattr(stage, "devices", None)
    if devices:
        entries = devices.split(",") if isinstance(devices, str) else list(devices)
        return sum(1 for d in entries if str(d).strip().startswith("cuda"))
    if not cluster_has_gpus:
        return 0
    return int(stage.options.get("tensor_parallel_size") or 1)


def stage_bundle(stage: Any, cluster_has_gpus: bool) -> dict[str, float]:
    """The resources of a stage's placement-group bundle (see the module docstring)."""
    bundle: dict[str, float] = {"CPU": 1, **(getattr(stage, "ray_resources", None) or {})}
    if "GPU" not in bundle:
        gpus = _stage_gpus(stage, cluster_has_gpus)
        if gpus:
            bundle["GPU"] = gpus
    return bundle


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES)}


@dataclasses.dataclass(eq=False)
class _Actor:
    """One started actor of a stage: the actor, its placement group, where it runs."""

    actor: Any
    placement_group: Any
    info: dict[str, Any]


class RayStageRuntime(SupervisedStageRuntime):
    """One stage in a Ray actor (the :class:`~vllm_omni.engine.protocols.StageRuntime` contract).

    Args:
        stage: the resolved stage config; ``stage.ray_resources`` places it.
        address: Ray cluster to use when this process is not connected yet (default
            ``RAY_ADDRESS``, else a new local cluster).
        config: the whole pipeline config, for the stage runtimes that read it.
        factory: the stage's registered runtime factory (``inline_runtime.runtime_factory``),
            handed to the actor; ``None`` for vLLM / diffusion stages.

    Attributes:
        info: where the actor runs: ``node_id``, ``pid``, ``accelerator_ids``, ``cuda_visible_devices``.
        restarts: actors started after a death so far.

    Raises:
        StageEngineError: the stage cannot be placed within :data:`PLACEMENT_TIMEOUT_S` (the
            message names the bundle and the cluster's resources) or its runtime failed to start.
    """

    def __init__(self, stage: Any, *, address: str | None = None, config: Any = None, factory: Any = None):
        super().__init__(stage)
        self.config = config
        self.factory = factory
        self._ids = itertools.count()
        self._resolver = ThreadPoolExecutor(1, thread_name_prefix=f"omni-ray-stage-{stage.stage_id}")
        connect(address)
        try:
            self._begin()
        except BaseException:
            self._resolver.shutdown(wait=False)
            disconnect()
            raise

    @property
    def actor(self) -> Any:
        """The serving actor (``None`` before the first start)."""
        return self._handle.actor if self._handle is not None else None

    @property
    def placement_group(self) -> Any:
        return self._handle.placement_group if self._handle is not None else None

    @property
    def info(self) -> dict[str, Any]:
        return self._handle.info if self._handle is not None else {}

    # ---------------------------------------------------------------- actor life
    def _describe(self, handle: _Actor) -> str:
        return f"actor pid {handle.info.get('pid')} on node {str(handle.info.get('node_id'))[:12]}"

    def _start_worker(self) -> _Actor:
        import ray  # the optional `ray` extra: imported on use (stage_factory imports this module)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = stage_bundle(self.stage, ray.cluster_resources().get("GPU", 0) > 0)
        pg = placement_group([bundle], strategy="STRICT_PACK")
        actor = None
        try:
            try:
                ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise StageEngineError(
                    f"{self.stage.label}: Ray cannot place the stage: no node offers {bundle} within "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.available_resources()}); "
                    f"check the stage's ray_resources / devices against the nodes' resources"
                ) from None
            custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
            actor = (
                ray.remote(StageActor)
                .options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    resources=custom,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
                    max_restarts=0,
                    runtime_env={"env_vars": _forwarded_env()},
                )
                .remote(self.stage, "OMP_NUM_THREADS" in os.environ, self.config, self.factory)
            )
            try:
                info = unwrap(ray.get(actor.info.remote()))
            except ray.exceptions.RayActorError as exc:
                raise StageEngineError(f"{self.stage.label}: its Ray actor failed to start: {exc}") from exc
        except BaseException:
            _release(actor, pg)
            raise
        logger.info("%s: Ray actor on node %s (pid %s)", self.stage.label, info["node_id"], info["pid"])
        return _Actor(actor, pg, info)

    def _stop_worker(self, handle: _Actor, timeout: float | None) -> None:
        """Shut the actor's runtime down (at most ``timeout`` s), kill the actor, remove its placement group."""
        import ray  # the optional `ray` extra: imported on use (stage_factory imports this module)

        with contextlib.suppress(Exception):
            ray.get(handle.actor.shutdown.remote(timeout), timeout=SHUTDOWN_S if timeout is None else timeout)
        _release(handle.actor, handle.placement_group)

    def _after_shutdown(self) -> None:
        self._resolver.shutdown(wait=False)
        disconnect()

    def _error(self, exc: BaseException, handle: _Actor) -> BaseException:
        """The error a caller sees for ``exc`` from a call on ``handle``'s actor."""
        import ray  # the optional `ray` extra: imported on use (stage_factory imports this module)

        if isinstance(exc, ray.exceptions.RayActorError):
            self._worker_died(handle, f"{type(exc).__name__}")
            return StageDeadError(f"{self.stage.label}: its Ray actor died: {type(exc).__name__}")
        if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, BaseException):
            return exc.cause
        return exc

    def _get(self, handle: _Actor, ref: Any) -> Any:
        import ray  # the optional `ray` extra: imported on use (stage_factory imports this module)

        try:
            value = ray.get(ref)
        except Exception as exc:
            raise self._error(exc, handle) from None
        return unwrap(value)

    def _worker_call(self, handle: _Actor, method: str, *args: Any) -> Any:
        return self._get(handle, handle.actor.call.remote(method, *args))

    # ---------------------------------------------------------------- StageRuntime
    def submit(self, request: StageRequest) -> Future:
        """Queue one request in the actor's runtime; the future resolves to its output.

        Same request, errors and cancellation as the inline runtime's ``submit`` (the
        checks run in the actor and raise here); ``request.on_partial`` is called from a thread
        of this process with each streamed piece. ``StageDeadError`` (synchronously or in the
        future) when the actor died; ``AdapterRestoreError`` for an adapter the last restart
        could not restore.
        """
        self.check_adapters(request)
        on_partial = request.on_partial
        request_id = f"r{next(self._ids)}"
        handle = self._serving()
        wire = dataclasses.replace(request, on_partial=None)
        self._get(handle, handle.actor.enqueue.remote(request_id, wire, on_partial is not None))
        pending = Pending(on_partial, handle=handle)
        self._track(request_id, pending)
        fut = pending.future
        fut.add_done_callback(functools.partial(self._finished, handle, request_id))
        if on_partial is None:
            ref = handle.actor.result.remote(request_id)
            ref.future().add_done_callback(lambda done: self._later(self._resolve, handle, fut, done))
        else:
            threading.Thread(
                target=self._consume_stream, args=(handle, request_id, fut, on_partial), daemon=True
            ).start()
        return fut

    def _later(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on this runtime's resolver thread (never on Ray's callback thread)."""
        with contextlib.suppress(RuntimeError):  # shut down: the futures were failed already
            self._resolver.submit(fn, *args)

    def _resolve(self, handle: _Actor, fut: Future, done: Future) -> None:
        if fut.done():
            return
        try:
            value = from_wire(unwrap(done.result()))
        except BaseException as exc:
            error = self._error(exc, handle)
            with contextlib.suppress(InvalidStateError):
                fut.set_exception(error)
            return
        with contextlib.suppress(InvalidStateError):
            fut.set_result(value)

    def _consume_stream(self, handle: _Actor, request_id: str, fut: Future, on_partial: Callable) -> None:
        import ray  # the optional `ray` extra: imported on use (stage_factory imports this module)

        try:
            for ref in handle.actor.stream.options(num_returns="streaming").remote(request_id):
                kind, value = ray.get(ref)
                if fut.done():
                    return
                if kind == "partial":
                    on_partial(value)
                else:
                    fut.set_result(from_wire(unwrap(value)))
        except Exception as exc:
            error = exc if isinstance(exc, InvalidStateError) else self._error(exc, handle)
            if not fut.done():
                handle.actor.cancel.remote(request_id)  # a failing consumer fails its own request only
                with contextlib.suppress(InvalidStateError):
                    fut.set_exception(error)

    def _finished(self, handle: _Actor, request_id: str, fut: Future) -> None:
        self._untrack(request_id)
        if fut.cancelled():
            with contextlib.suppress(Exception):
                handle.actor.cancel.remote(request_id)

    def validate_request(self, request: StageRequest) -> None:
        """Every check of :meth:`submit`, run in the actor, queueing nothing."""
        self.check_adapters(request)
        handle = self._serving()
        self._get(handle, handle.actor.validate_request.remote(dataclasses.replace(request, on_partial=None)))

    def prepare_params(self, params: Any) -> Any:
        """The actor's runtime's ``prepare_params`` (each stage runtime knows its own params type)."""
        return self._call("prepare_params", params)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Requests submitted inside the block start together when it exits (the actor's runtime holds)."""
        token = next(self._ids)
        try:
            handle = self._serving()
            self._get(handle, handle.actor.hold_enter.remote(token))
        except StageEngineError:  # shut down or dead: nothing to hold
            yield
            return
        try:
            yield
        finally:
            with contextlib.suppress(StageEngineError):
                self._get(handle, handle.actor.hold_exit.remote(token))


def _release(actor: Any, pg: Any) -> None:
    """Kill ``actor`` and remove ``pg`` (either may be ``None``; errors ignored)."""
    import ray  # the optional `ray` extra: imported on use (stage_factory imports this module)
    from ray.util.placement_group import remove_placement_group

    if actor is not None:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    if pg is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
