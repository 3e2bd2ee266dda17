"""``worker_backend="ray"``: each stage runs in its own Ray actor, placed by resources.

:class:`RayStageRuntime` implements the :class:`~vllm_omni.engine.protocols.StageRuntime`
contract in the caller's process; its actor (:class:`~vllm_omni.engine.workers.ray_actor.StageActor`)
builds the ordinary inline runtime of the stage (``make_inline_runtime``), so batching, LoRA
and streaming behave as with the inline backend. Outputs travel through Ray's object store
(CPU tensors as numpy arrays).

Cluster. The first runtime connects (``address``, else ``RAY_ADDRESS``, else a new local
cluster without dashboard; ``RAY_AUTH_MODE=disabled`` unless set); a local cluster started
here is shut down when the last runtime shuts down. A driver that is already connected
(``ray.init`` called before) keeps its connection.

Placement. Each stage gets a one-bundle placement group: ``{"CPU": 1}`` plus the stage's
``ray_resources`` (e.g. ``{"node_a": 1}``: custom resources a node was started with) and,
unless ``ray_resources`` names ``"GPU"``, one GPU per ``cuda`` entry of the stage's
``devices`` or, on a cluster with GPUs, per tensor-parallel rank. Ray sets
``CUDA_VISIBLE_DEVICES`` of the actor for GPUs it grants; custom resources set no device
variable.

Failures. A dead actor (killed, crashed, its node removed) fails the stage's requests in
flight with :class:`~vllm_omni.errors.StageDeadError` naming the stage; the runtime then
starts a new actor (at most :data:`MAX_RESTARTS` attempts per death, with back-off) and
replays the adapters added and pinned at run time. Until it is back, calls raise
``StageDeadError``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from vllm_omni.engine.workers.lora_journal import LoRAJournal
from vllm_omni.engine.workers.ray_actor import StageActor, from_wire
from vllm_omni.errors import StageDeadError, StageEngineError

logger = logging.getLogger(__name__)

#: Attempts to start a new actor after one died (then the stage stays dead).
MAX_RESTARTS = 3
#: Seconds before the first restart attempt (doubled per further attempt).
RESTART_BACKOFF_S = 0.5
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
    import ray

    with _cluster_lock:
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS") or None
            # a new local cluster: no dashboard (connecting to one, Ray refuses local options)
            ray.init(**({"address": address} if address else {"include_dashboard": False}))
            _cluster["owned"] = address is None
        _cluster["users"] += 1


def disconnect() -> None:
    """Drop one user; the last one shuts down a local cluster started by :func:`connect`."""
    import ray

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


class RayStageRuntime:
    """One stage in a Ray actor (the :class:`~vllm_omni.engine.protocols.StageRuntime` contract).

    Args:
        stage: the resolved stage config; ``stage.ray_resources`` places it.
        address: Ray cluster to use when this process is not connected yet (default
            ``RAY_ADDRESS``, else a new local cluster).

    Attributes:
        info: where the actor runs: ``node_id``, ``pid``, ``accelerator_ids``, ``cuda_visible_devices``.
        restarts: actors started after a death so far.

    Raises:
        StageEngineError: the stage cannot be placed within :data:`PLACEMENT_TIMEOUT_S` (the
            message names the bundle and the cluster's resources) or its runtime failed to start.
    """

    def __init__(self, stage: Any, *, address: str | None = None):
        self.stage = stage
        self.actor: Any = None
        self.placement_group: Any = None
        self.info: dict[str, Any] = {}
        self._description: Any = None
        self.restarts = 0
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[str, Future] = {}
        self._closed = False
        self._down: StageDeadError | None = None
        self._gave_up = False
        self._journal = LoRAJournal()
        self._resolver = ThreadPoolExecutor(1, thread_name_prefix=f"omni-ray-stage-{stage.stage_id}")
        connect(address)
        try:
            self.actor, self.placement_group, self.info = self._start()
        except BaseException:
            self._closed = True
            self._resolver.shutdown(wait=False)
            disconnect()
            raise

    # ---------------------------------------------------------------- actor life
    def _start(self) -> tuple[Any, Any, dict[str, Any]]:
        import ray
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
                .remote(self.stage, "OMP_NUM_THREADS" in os.environ)
            )
            try:
                info = ray.get(actor.info.remote())
            except ray.exceptions.RayActorError as exc:
                raise StageEngineError(f"{self.stage.label}: its Ray actor failed to start: {exc}") from exc
        except BaseException:
            _release(actor, pg)
            raise
        logger.info("%s: Ray actor on node %s (pid %s)", self.stage.label, info["node_id"], info["pid"])
        return actor, pg, info

    def _on_dead(self, actor: Any) -> None:
        """First news of ``actor``'s death: fail its requests, start the restart thread."""
        with self._lock:
            if self._closed or actor is not self.actor or self._down is not None:
                return
            self._down = StageDeadError(f"{self.stage.label}: its Ray actor died; restarting it")
            pending = list(self._pending.values())
        err = StageDeadError(f"{self.stage.label}: its Ray actor died with this request in flight")
        for fut in pending:
            with contextlib.suppress(InvalidStateError):
                fut.set_exception(err)
        threading.Thread(
            target=self._restart, name=f"omni-ray-restart-{self.stage.stage_id}", daemon=True
        ).start()

    def _restart(self) -> None:
        _release(self.actor, self.placement_group)
        for attempt in range(MAX_RESTARTS):
            time.sleep(RESTART_BACKOFF_S * 2**attempt)
            if self._closed:
                return
            try:
                actor, pg, info = self._start()
            except Exception as exc:
                logger.warning("%s: restart attempt %d failed: %s", self.stage.label, attempt + 1, exc)
                continue
            try:
                self._journal.replay(functools.partial(self._replay_call, actor))
            except Exception as exc:
                logger.warning("%s: replaying adapters after a restart failed: %s", self.stage.label, exc)
                _release(actor, pg)
                continue
            with self._lock:
                if not self._closed:
                    self.actor, self.placement_group, self.info = actor, pg, info
                    self._down = None
                    self.restarts += 1
                    logger.warning("%s: Ray actor restarted on node %s", self.stage.label, info["node_id"])
                    return
            _release(actor, pg)  # shut down meanwhile
            return
        with self._lock:
            self._gave_up = True
            self._down = StageDeadError(
                f"{self.stage.label}: its Ray actor died and {MAX_RESTARTS} restart attempts failed"
            )

    def _replay_call(self, actor: Any, method: str, *args: Any) -> Any:
        return self._get(actor, actor.call.remote(method, *args))

    def _usable_actor(self) -> Any:
        with self._lock:
            if self._closed:
                raise StageEngineError(f"{self.stage.label} is shut down")
            if self._down is not None:
                raise self._down
            return self.actor

    def _error(self, exc: BaseException, actor: Any) -> BaseException:
        """The error a caller sees for ``exc`` from a call on ``actor`` (the actor's own exception as is)."""
        import ray

        if isinstance(exc, ray.exceptions.RayActorError):
            self._on_dead(actor)
            return StageDeadError(f"{self.stage.label}: its Ray actor died: {type(exc).__name__}")
        if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, BaseException):
            return exc.cause
        return exc

    def _get(self, actor: Any, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref)
        except Exception as exc:
            raise self._error(exc, actor) from None

    def _call(self, method: str, *args: Any) -> Any:
        actor = self._usable_actor()
        return self._get(actor, getattr(actor, method).remote(*args))

    # ---------------------------------------------------------------- StageRuntime
    def submit(
        self, prompt: Any, params: Any, lora_request: Any = None, on_partial=None, **kwargs: Any
    ) -> Future:
        """Queue one request in the actor's runtime; the future resolves to its output.

        Same arguments, errors and cancellation as the inline runtime's ``submit`` (the
        checks run in the actor and raise here); ``on_partial`` is called from a thread of
        this process with each streamed piece. ``StageDeadError`` (synchronously or in the
        future) when the actor died.
        """
        request_id = f"r{next(self._ids)}"
        actor = self._usable_actor()
        self._get(
            actor,
            actor.enqueue.remote(request_id, prompt, params, lora_request, kwargs, on_partial is not None),
        )
        fut: Future = Future()
        with self._lock:
            self._pending[request_id] = fut
        fut.add_done_callback(functools.partial(self._finished, actor, request_id))
        if on_partial is None:
            ref = actor.result.remote(request_id)
            ref.future().add_done_callback(lambda done: self._later(self._resolve, actor, fut, done))
        else:
            threading.Thread(
                target=self._consume_stream, args=(actor, request_id, fut, on_partial), daemon=True
            ).start()
        return fut

    def _later(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on this runtime's resolver thread (never on Ray's callback thread)."""
        with contextlib.suppress(RuntimeError):  # shut down: the futures were failed already
            self._resolver.submit(fn, *args)

    def _resolve(self, actor: Any, fut: Future, done: Future) -> None:
        if fut.done():
            return
        try:
            value = from_wire(done.result())
        except BaseException as exc:
            error = self._error(exc, actor)
            with contextlib.suppress(InvalidStateError):
                fut.set_exception(error)
            return
        with contextlib.suppress(InvalidStateError):
            fut.set_result(value)

    def _consume_stream(self, actor: Any, request_id: str, fut: Future, on_partial: Callable) -> None:
        import ray

        try:
            for ref in actor.stream.options(num_returns="streaming").remote(request_id):
                kind, value = ray.get(ref)
                if fut.done():
                    return
                if kind == "partial":
                    on_partial(value)
                else:
                    fut.set_result(from_wire(value))
        except Exception as exc:
            error = exc if isinstance(exc, InvalidStateError) else self._error(exc, actor)
            if not fut.done():
                actor.cancel.remote(request_id)  # a failing consumer fails its own request only
                with contextlib.suppress(InvalidStateError):
                    fut.set_exception(error)

    def _finished(self, actor: Any, request_id: str, fut: Future) -> None:
        with self._lock:
            self._pending.pop(request_id, None)
        if fut.cancelled():
            with contextlib.suppress(Exception):
                actor.cancel.remote(request_id)

    def validate_request(self, prompt: Any, params: Any, lora_request: Any = None, **kwargs: Any) -> None:
        """Every check of :meth:`submit`, run in the actor, queueing nothing."""
        self._call("validate_request", prompt, params, lora_request, kwargs)

    def prepare_params(self, params: Any) -> Any:
        """As the inline runtime of the stage does it (computed here, no actor call)."""
        if self.stage.is_llm:
            from vllm_omni.engine.llm_stage import LLMStageEngine

            return LLMStageEngine.prepare_params(params)
        return params

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Requests submitted inside the block start together when it exits (the actor's runtime holds)."""
        token = next(self._ids)
        try:
            self._call("hold_enter", token)
        except StageEngineError:  # shut down or dead: nothing to hold
            yield
            return
        try:
            yield
        finally:
            with contextlib.suppress(StageEngineError):
                self._call("hold_exit", token)

    def health(self) -> str:
        """``"ready"``, ``"restarting"`` (its actor died and is being replaced) or ``"dead"``."""
        if self._closed or self._gave_up:
            return "dead"
        return "restarting" if self._down is not None else "ready"

    def _lora(self, method: str, *args: Any) -> Any:
        result = self._call("call", method, *args)
        if method != "pin_lora" or result:
            self._journal.record(method, args)
        return result

    def add_lora(self, lora_request: Any) -> bool:
        """As the inline runtime (errors raised in the actor are raised here); remembered for a restart."""
        return self._lora("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora("remove_lora", lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self._lora("list_loras"))

    def describe(self) -> Any:
        """The actor runtime's ``StageDescription`` (asked once, then kept: a new actor runs the
        same stage config)."""
        if self._description is None:
            self._description = self._call("call", "describe")
        return self._description

    def pin_lora(self, lora_int_id: int) -> bool:
        return self._lora("pin_lora", lora_int_id)

    def stats(self) -> Any:
        """The actor runtime's statistics snapshot (:class:`~vllm_omni.stats.StageStats`)."""
        return self._call("call", "stats")

    def shutdown(self, timeout: float | None = None) -> None:
        """Shut the actor's runtime down, kill the actor, remove its placement group (idempotent).

        Requests still pending fail with ``StageEngineError``; ``timeout`` bounds the whole
        call (default :data:`SHUTDOWN_S` for the runtime), then the actor is killed anyway.
        """
        import ray

        with self._lock:
            if self._closed:
                return
            self._closed = True
            actor, pg, down = self.actor, self.placement_group, self._down
            pending = list(self._pending.values())
        if actor is not None and down is None:
            with contextlib.suppress(Exception):
                ray.get(actor.shutdown.remote(timeout), timeout=SHUTDOWN_S if timeout is None else timeout)
        err = StageEngineError(f"{self.stage.label}: shut down")
        for fut in pending:
            with contextlib.suppress(InvalidStateError):
                fut.set_exception(err)
        _release(actor, pg)
        self._resolver.shutdown(wait=False)
        disconnect()


def _release(actor: Any, pg: Any) -> None:
    """Kill ``actor`` and remove ``pg`` (either may be ``None``; errors ignored)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if actor is not None:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    if pg is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
