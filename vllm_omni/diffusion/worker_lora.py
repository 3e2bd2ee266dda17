"""LoRA state of one diffusion worker (one tensor-parallel rank).

Built by :class:`~vllm_omni.diffusion.worker.DiffusionWorker` right after the pipeline is
loaded, in this order:

1. ``lora_backend="distill"``: the ``lora_path`` file(s) are fused into the base weights once
   (``fuse_lora_files_into_pipeline``: the i-th file into the i-th denoiser, scaled by
   ``lora_scale``).
2. A :class:`~vllm_omni.diffusion.lora.DiffusionLoRAManager` patches the denoiser(s) with
   ``max_loras`` device slots, ``max_lora_rank`` and a ``max_cpu_loras`` host cache. This
   happens for both backends, so request adapters add on top of a distilled model too.
3. ``lora_backend="peft"``: every ``lora_path`` adapter is loaded and pinned, under the id
   ``stable_lora_int_id(path)``; a request that names it without a scale gets ``lora_scale``.

Every rank runs the same calls with the same arguments, so the caches of all ranks agree.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.request import LoRARequest, RequestAdapter, startup_lora_request
from vllm_omni.lora.schedule import LoRAScaleSchedule

#: One request's adapters, each with its scale (``None``: the default applies).
LoRASet = tuple[RequestAdapter, ...]


class WorkerLoRA:
    """Owns the manager of one worker and turns per-prompt adapter sets into activations.

    Args:
        pipeline: the loaded pipeline (``transformer`` / ``transformer_2`` are patched).
        od_config: the engine config (LoRA fields).

    Attributes:
        manager: the :class:`DiffusionLoRAManager`.
        fused: for the distill backend, denoiser attribute -> fused layer names.
        startup_requests: the pinned ``lora_path`` adapters (PEFT backend).

    Raises:
        LoRAFormatError / FileNotFoundError / ValueError: a start-up adapter cannot be read or
            fused (the worker fails to start, naming the file).
    """

    def __init__(self, pipeline: Any, od_config: OmniDiffusionConfig):
        from vllm_omni.diffusion.lora import DiffusionLoRAManager, fuse_lora_files_into_pipeline

        self.od_config = od_config
        self.reports_steps = bool(getattr(pipeline, "reports_denoising_step", False))
        self.pipeline_name = type(pipeline).__name__
        paths = od_config.startup_lora_paths
        scale = float(od_config.lora_scale)
        self.fused: dict[str, list[str]] = {}
        if od_config.lora_backend == "distill" and paths:
            self.fused = fuse_lora_files_into_pipeline(pipeline, paths, [scale] * len(paths))
        self.manager = DiffusionLoRAManager(
            pipeline,
            max_loras=od_config.max_loras,
            max_rank=od_config.max_lora_rank,
            max_cpu_loras=od_config.max_cpu_loras,
        )
        self.default_scales: dict[int, float] = {}
        self.startup_requests: list[LoRARequest] = []
        #: statistics not yet taken by :meth:`drain_events`: ``(event, adapter name, value)``
        self._events: list[tuple[str, str, float]] = []
        self._names: dict[int, str] = {}
        if od_config.lora_backend == "peft":
            for path in paths:
                request = startup_lora_request(path)
                self.add_lora(request)
                self.pin_lora(request.lora_int_id)
                self.default_scales[request.lora_int_id] = scale
                self.startup_requests.append(request)

    # ------------------------------------------------------------------ management
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load into the host cache; ``True`` if it was loaded now, ``False`` if already cached."""
        name = self._name(lora_request)
        try:
            return bool(self._loading([lora_request], lambda: self.manager.add_lora(lora_request), False))
        except Exception:
            self._events.append(("registration_failures", name, 1))
            raise

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop from cache and slot; ``False`` when not cached. ``LoRACacheError`` while in use."""
        self.default_scales.pop(lora_int_id, None)
        removed = self.manager.remove_lora(lora_int_id)
        if removed:
            self._events.append(("unloaded", self._names.get(lora_int_id, str(lora_int_id)), 0))
        return removed

    def list_loras(self) -> list[int]:
        """Cached adapter ids, least recently used first."""
        return self.manager.list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        """Pin a cached adapter (``ValueError`` when it is not cached)."""
        pinned = self.manager.pin_lora(lora_int_id)
        self._events.append(("pinned", self._names.get(lora_int_id, str(lora_int_id)), 1))
        return pinned

    # ------------------------------------------------------------------ statistics
    def _name(self, lora: LoRARequest) -> str:
        name = self._names[lora.lora_int_id] = lora.lora_name or str(lora.lora_int_id)
        return name

    def _loading(self, requests: Sequence[LoRARequest], load: Callable[[], Any], for_request: bool) -> Any:
        """Run ``load`` (which may read ``requests`` into the host cache) and note what it did: cache
        hits and misses (``for_request``: a request needs them), load seconds (a call that loaded several adapters splits its time evenly)
        and the adapters it evicted."""
        before = set(self.manager.list_loras())
        start = time.perf_counter()
        result = load()
        seconds = time.perf_counter() - start
        after = set(self.manager.list_loras())
        missed = {r.lora_int_id: self._name(r) for r in requests if r.lora_int_id not in before}
        for lora in requests:
            hit = lora.lora_int_id not in missed
            if for_request:
                self._events.append(("cache_hits" if hit else "cache_misses", self._name(lora), 1))
        for name in missed.values():
            self._events.append(("loaded", name, seconds / len(missed)))
        for lora_int_id in before - after:
            self._events.append(("evicted", self._names.get(lora_int_id, str(lora_int_id)), 1))
        return result

    def note_batch(self, sets: Sequence[LoRASet]) -> None:
        """Count a denoiser batch's device-slot hits and misses (once per distinct adapter)."""
        resident = self.manager.slot_assignment()
        for lora in {a.lora.lora_int_id: a.lora for s in sets for a in s}.values():
            hit = lora.lora_int_id in resident
            self._events.append(("slot_hits" if hit else "slot_misses", self._name(lora), 1))

    def note_steps(self, seconds: Sequence[float]) -> None:
        """Record the seconds of each denoising step of a batch (event ``step``)."""
        self._events.extend(("step", "", float(t)) for t in seconds)

    def drain_events(self) -> list[tuple[str, str, float]]:
        """The statistics events since the last call, oldest first (see ``StatsRecorder.apply``)."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ requests
    def resolve_scales(self, adapters: LoRASet) -> list[float | LoRAScaleSchedule]:
        """Per adapter its scale, or the start-up ``lora_scale`` / ``1.0`` when it has none (a
        schedule without ``steps`` gets that default as its step scale)."""
        out: list[float | LoRAScaleSchedule] = []
        for a in adapters:
            default = self.default_scales.get(a.lora.lora_int_id, 1.0)
            if isinstance(a.scale, LoRAScaleSchedule):
                out.append(a.scale.with_default(default))
            else:
                out.append(default if a.scale is None else float(a.scale))
        return out

    def check_schedules(self, adapters: LoRASet) -> None:
        """Refuse schedules this stage cannot run, before any adapter is loaded.

        Raises:
            InvalidRequestError: a per-step schedule on a pipeline that does not report its steps.
            InvalidAdapterError: a block pattern or index that matches no LoRA layer.
        """
        for a in adapters:
            if not isinstance(a.scale, LoRAScaleSchedule):
                continue
            where = f"scale of LoRA {a.lora.lora_int_id} ({a.lora.lora_name!r})"
            if a.scale.varies_with_step and not self.reports_steps:
                raise InvalidRequestError(
                    f"{where}: per-step scales need a pipeline that reports its denoising steps "
                    f"(in-tree pipelines); {self.pipeline_name} does not"
                )
            self.manager.block_factors(a.scale, where)

    def acquire(self, adapters: LoRASet) -> list[int]:
        """Check a request's schedules, then load (if needed) and hold its adapters; nothing changes on
        failure (see :meth:`check_schedules` for the schedule errors)."""
        self.check_schedules(adapters)
        if not adapters:
            return []
        loras = [a.lora for a in adapters]
        return self._loading(loras, lambda: self.manager.acquire_loras(loras), True)

    def release(self, ids: Sequence[int]) -> None:
        if ids:
            self.manager.release_loras(ids)

    def context_factory(
        self, sets: Sequence[LoRASet]
    ) -> Callable[[list[int] | None], AbstractContextManager]:
        """The ``lora_context`` callback for a pipeline call whose i-th prompt uses ``sets[i]``.

        The callback receives the prompt index of every denoiser sample (CFG copies included)
        and activates a per-sample scale matrix; with ``None`` (a pipeline that cannot report
        its layout) every prompt must share one set, which is then applied to the whole batch.

        Raises (from the callback):
            ValueError: ``None`` layout but the prompts' sets differ.
        """
        resolved = [([a.lora for a in adapters], self.resolve_scales(adapters)) for adapters in sets]

        def make(sample_prompts: list[int] | None) -> AbstractContextManager:
            if not any(reqs for reqs, _ in resolved):
                return contextlib.nullcontext()
            if sample_prompts is None:
                keys = {(tuple(r.lora_int_id for r in reqs), tuple(s)) for reqs, s in resolved}
                if len(keys) != 1:
                    raise ValueError(
                        "this pipeline runs one LoRA set per call; got prompts with different sets"
                    )
                reqs, scales = resolved[0]
                return self.manager.activate(reqs, scales)
            return self.manager.activate(
                [resolved[i][0] for i in sample_prompts], [resolved[i][1] for i in sample_prompts]
            )

        return make
