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
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.lora import DiffusionLoRAManager, fuse_lora_files_into_pipeline
from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.request import LoRARequest, RequestAdapter, stable_lora_int_id
from vllm_omni.lora.schedule import LoRAScaleSchedule

#: One request's adapters, each with its scale (``None``: the default applies).
LoRASet = tuple[RequestAdapter, ...]


def startup_lora_request(path: str) -> LoRARequest:
    """The ``LoRARequest`` under which a ``lora_path`` adapter is pre-loaded (id from the path)."""
    name = os.path.basename(os.path.normpath(path)) or "startup"
    return LoRARequest(lora_name=name, lora_int_id=stable_lora_int_id(path), lora_path=path)


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
        if od_config.lora_backend == "peft":
            for path in paths:
                request = startup_lora_request(path)
                self.manager.add_lora(request)
                self.manager.pin_lora(request.lora_int_id)
                self.default_scales[request.lora_int_id] = scale
                self.startup_requests.append(request)

    # ------------------------------------------------------------------ management
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load into the host cache; ``True`` if it was loaded now, ``False`` if already cached."""
        return self.manager.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop from cache and slot; ``False`` when not cached. ``LoRACacheError`` while in use."""
        self.default_scales.pop(lora_int_id, None)
        return self.manager.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        """Cached adapter ids, least recently used first."""
        return self.manager.list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        """Pin a cached adapter (``ValueError`` when it is not cached)."""
        return self.manager.pin_lora(lora_int_id)

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
        return self.manager.acquire_loras([a.lora for a in adapters]) if adapters else []

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
