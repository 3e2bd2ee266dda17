"""Step-level batching of a diffusion stage, worker side (stage option ``batching="step"``).

A :class:`StepBatcher` lives on every tensor-parallel rank of a stage whose pipeline offers a per-step
unit (:mod:`vllm_omni.diffusion.pipelines.step_unit`; :data:`STEP_UNITS` lists them). The stage's
driver thread (:mod:`vllm_omni.engine.diffusion_steps`) calls, on every rank, through
``DiffusionEngine.collective_rpc`` and the module-level functions below:

* :func:`step_admit`: requests join. Each one's adapters are loaded and held, its prompt encoded
  (text-encoder LoRA parts included), its noise drawn and its own scheduler set; a request that fails
  here (an adapter that cannot load, an argument the pipeline refuses) fails alone and never joins.
* :func:`step_run`: cancelled requests leave; then one denoiser step runs for the running requests
  whose latents share a shape (shapes take turns, the one that waited longest first), each request at
  its own step index and timestep, with its own guidance, CFG rows, seed and adapters. A per-step or
  per-block LoRA scale schedule is resolved at the request's own step (``scale_at(step, num_steps)``),
  so one denoiser call may hold rows at different steps of different schedules. Finished requests
  leave and are decoded.

A request's result never depends on its neighbours: the denoiser treats samples independently, and
each request keeps its own generator, scheduler object and adapter row scales. When a shared call
fails, each request of it runs its step alone, so only a request that fails alone fails.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni.diffusion.forward_context import set_forward_context
from vllm_omni.diffusion.pipelines.step_unit import StepRows, StepUnit
from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.ipc import dump_error, load_error
from vllm_omni.lora.request import RequestAdapters
from vllm_omni.lora.schedule import LoRAScaleSchedule

#: pipeline class name -> ``"module:Class"`` of its step unit (constructed with the pipeline).
STEP_UNITS: dict[str, str] = {
    name: "vllm_omni.diffusion.pipelines.template_steps:TemplateSteps"
    for name in ("ZImagePipeline", "QwenImagePipeline", "WanPipeline")
}


def step_unit_for(pipeline: Any) -> StepUnit | None:
    """The step unit of ``pipeline`` (``None``: the pipeline runs whole requests only, e.g. the
    diffusers fallback)."""
    target = STEP_UNITS.get(type(pipeline).__name__)
    if target is None:
        return None
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(pipeline)


@dataclass
class _Running:
    rid: int
    prompt: str
    output_type: str
    adapters: RequestAdapters
    held: list
    rows: StepRows
    admitted: int  # admission order (the oldest request's shape goes first on ties)


def at_step(adapters: RequestAdapters, step: int, num_steps: int) -> RequestAdapters:
    """``adapters`` with every per-step schedule replaced by its value at ``step`` of ``num_steps``
    (block multipliers kept): what the LoRA manager publishes for that step in a whole-request batch."""
    if not any(isinstance(a.scale, LoRAScaleSchedule) and a.scale.varies_with_step for a in adapters):
        return adapters
    items = []
    for a in adapters:
        scale = a.scale
        if isinstance(scale, LoRAScaleSchedule) and scale.varies_with_step:
            value = scale.scale_at(step, num_steps)
            scale = LoRAScaleSchedule(value, scale.blocks) if scale.blocks else value
        items.append(dataclasses.replace(a, scale=scale))
    return RequestAdapters(tuple(items))


class StepBatcher:
    """The running requests of one rank and the step loop over them (module docstring).

    Args:
        worker: the rank's :class:`~vllm_omni.diffusion.worker.DiffusionWorker` (its pipeline and
            :class:`~vllm_omni.diffusion.worker_lora.WorkerLoRA`).
        unit: the pipeline's step unit.
    """

    def __init__(self, worker: Any, unit: StepUnit) -> None:
        self.worker = worker
        self.lora = worker.lora
        self.unit = unit
        self.running: dict[int, _Running] = {}
        self._admitted = 0
        self._last_turn: dict[tuple, int] = {}  # batch key -> tick of its last step
        self._tick = 0

    # ------------------------------------------------------------------ admission
    def admit(
        self,
        rid: int,
        prompt: str,
        sp: OmniDiffusionSamplingParams,
        adapters: RequestAdapters,
        seed: int | None,
    ) -> None:
        """Prepare request ``rid`` and add it to the running set (nothing kept when it raises).

        Raises:
            InvalidRequestError: ``rid`` already runs, or the pipeline refuses an argument.
            LoRAFormatError / LoRACacheError / ...: an adapter cannot be loaded or held.
        """
        if rid in self.running:
            raise InvalidRequestError(f"request {rid} is already running")
        held = self.lora.acquire(adapters)
        try:
            self.lora.note_batch([adapters])
            context = self.lora.context_factory([adapters])
            rows = self.unit.prepare(prompt, sp, seed, context)
            scale_of = getattr(self.unit, "lora_scale", None)
            adapters = self._times(adapters, 1.0 if scale_of is None else scale_of(rows))
        except BaseException:
            self.lora.release(held)
            raise
        self.running[rid] = _Running(rid, prompt, sp.output_type, adapters, held, rows, self._admitted)
        self._admitted += 1

    def _times(self, adapters: RequestAdapters, factor: float) -> RequestAdapters:
        """``adapters`` at their scales (stage defaults resolved) times a request's call-wide LoRA scale
        (``factor``; schedules: every step scale), as the whole-request path multiplies them."""
        if factor == 1.0 or not adapters:
            return adapters
        scales = self.lora.resolve_scales(adapters)
        return RequestAdapters(
            tuple(
                dataclasses.replace(
                    a, scale=s.times(factor) if isinstance(s, LoRAScaleSchedule) else s * factor
                )
                for a, s in zip(adapters, scales, strict=True)
            )
        )

    def drop(self, rids: Sequence[int]) -> None:
        """Remove requests (cancelled) and release their adapters; unknown ids are ignored."""
        for rid in rids:
            item = self.running.pop(rid, None)
            if item is not None:
                self.lora.release(item.held)

    # ------------------------------------------------------------------ steps
    def next_batch(self) -> list[_Running]:
        """The running requests that share the next denoiser call: the batch key whose last turn is the
        oldest (a new key first; ties: the key of the earliest admitted request), in admission order."""
        groups: dict[tuple, list[_Running]] = {}
        for item in self.running.values():
            groups.setdefault(self.unit.key(item.rows), []).append(item)
        if not groups:
            return []
        key = min(groups, key=lambda k: (self._last_turn.get(k, -1), groups[k][0].admitted))
        self._tick += 1
        self._last_turn[key] = self._tick
        for stale in set(self._last_turn) - set(groups):
            del self._last_turn[stale]
        return groups[key]

    def step(self) -> tuple[list[tuple[int, Any]], int]:
        """One denoiser step of :meth:`next_batch`; returns ``(finished, rows)``: the requests that left
        (``(rid, DiffusionOutput or the exception that ended it)``) and the denoiser samples of the call."""
        batch = self.next_batch()
        if not batch:
            return [], 0
        finished: list[tuple[int, Any]] = []
        try:
            outputs = self._predict(batch)
        except Exception as exc:
            if len(batch) == 1:
                finished.append((batch[0].rid, exc))
                outputs = [None]
            else:  # each alone: only a request that fails alone fails
                outputs = []
                for item in batch:
                    try:
                        outputs.extend(self._predict([item]))
                    except Exception as alone:
                        finished.append((item.rid, alone))
                        outputs.append(None)
        for item, out in zip(batch, outputs, strict=True):
            if out is None:
                continue
            try:
                item.rows.advance(out)
            except Exception as exc:
                finished.append((item.rid, exc))
        failed = {rid for rid, _ in finished}
        self.drop([item.rid for item in batch if item.rid in failed])
        done = [item for item in batch if item.rid not in failed and item.rows.done]
        for item in done:
            self.running.pop(item.rid)
            self.lora.release(item.held)
        by_type: dict[str, list[_Running]] = {}
        for item in done:
            by_type.setdefault(item.output_type, []).append(item)
        for output_type, items in by_type.items():
            finished += self._finish(items, output_type)
        return finished, sum(item.rows.rows for item in batch)

    def _finish(self, items: Sequence[_Running], output_type: str) -> list[tuple[int, Any]]:
        """Decode ``items`` together; when that fails, each alone (only one that fails alone fails)."""
        try:
            outputs = self.unit.finish([i.prompt for i in items], [i.rows for i in items], output_type)
            return [(item.rid, out) for item, out in zip(items, outputs, strict=True)]
        except Exception as exc:
            if len(items) == 1:
                return [(items[0].rid, exc)]
        return [pair for item in items for pair in self._finish([item], output_type)]

    def _predict(self, batch: Sequence[_Running]) -> list[torch.Tensor]:
        """The step unit's outputs for ``batch``, each request's adapters at its own step."""
        sets = [at_step(item.adapters, item.rows.step, item.rows.num_steps) for item in batch]
        rows = [i for i, item in enumerate(batch) for _ in range(item.rows.rows)]
        start = time.perf_counter()
        with torch.no_grad(), self.lora.context_factory(sets)(rows), set_forward_context():
            outputs = self.unit.predict([item.rows for item in batch])
        self.lora.note_steps([time.perf_counter() - start])
        return outputs


# ---------------------------------------------------------------------- calls on every rank
def _batcher(worker: Any) -> StepBatcher:
    batcher = getattr(worker, "step_batcher", None)
    if batcher is None:
        unit = step_unit_for(worker.pipeline)
        if unit is None:
            raise InvalidRequestError(
                f"{type(worker.pipeline).__name__} has no per-step unit; it runs with batching='request'"
            )
        batcher = worker.step_batcher = StepBatcher(worker, unit)
    return batcher


def _crossing(worker: Any, exc: BaseException) -> BaseException:
    """``exc`` as it crosses to the engine from a rank process (class kept, traceback as a note)."""
    return load_error(dump_error(exc, "diffusion worker")) if worker.world_size > 1 else exc


def step_supported(worker: Any) -> bool:
    """Whether the rank's pipeline has a per-step unit (:data:`STEP_UNITS`)."""
    return type(worker.pipeline).__name__ in STEP_UNITS


def step_admit(worker: Any, requests: Sequence[tuple]) -> list[BaseException | None] | None:
    """Admit ``(rid, prompt, params, adapters, seed)`` requests (:meth:`StepBatcher.admit`); on rank 0
    per request ``None`` (it runs) or the exception that kept it out; ``None`` on other ranks."""
    batcher = _batcher(worker)
    errors: list[BaseException | None] = []
    for rid, prompt, sp, adapters, seed in requests:
        try:
            batcher.admit(rid, prompt, sp, adapters, seed)
            errors.append(None)
        except Exception as exc:
            errors.append(_crossing(worker, exc))
    return errors if worker.rank == 0 else None


def step_run(worker: Any, cancelled: Sequence[int] = ()) -> dict[str, Any] | None:
    """Drop ``cancelled`` requests, then run one step (:meth:`StepBatcher.step`). On rank 0
    ``{"finished": [(rid, output or exception)], "rows": samples in the call, "running": requests
    still running}``; ``None`` on other ranks."""
    batcher = _batcher(worker)
    batcher.drop(cancelled)
    finished, rows = batcher.step()
    if worker.rank != 0:
        return None
    finished = [(rid, _crossing(worker, r) if isinstance(r, BaseException) else r) for rid, r in finished]
    return {"finished": finished, "rows": rows, "running": len(batcher.running)}


def step_reset(worker: Any) -> None:
    """Drop every running request (the driver gave up on them)."""
    batcher = getattr(worker, "step_batcher", None)
    if batcher is not None:
        batcher.drop(list(batcher.running))


__all__ = [
    "STEP_UNITS",
    "StepBatcher",
    "at_step",
    "step_admit",
    "step_reset",
    "step_run",
    "step_supported",
    "step_unit_for",
]
