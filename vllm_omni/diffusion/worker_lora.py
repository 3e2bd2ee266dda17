"""LoRA state of one diffusion worker (one tensor-parallel rank).

Built by :class:`~vllm_omni.diffusion.worker.DiffusionWorker` right after the pipeline is
loaded, in this order:

1. ``lora_backend="distill"``: the ``lora_path`` file(s) are fused into the base weights once
   (``fuse_lora_files_into_pipeline``: the i-th file into the i-th denoiser, its text-encoder
   parts into the text encoders, scaled by ``lora_scale``).
2. A :class:`~vllm_omni.diffusion.lora.DiffusionLoRAManager` per denoiser patches it with
   ``max_loras`` device slots, ``max_lora_rank`` and a ``max_cpu_loras`` host cache. This
   happens for both backends, so request adapters add on top of a distilled model too. The
   pipeline's text encoders get one manager each
   (:class:`~vllm_omni.diffusion.lora.text_encoder_lora.TextEncoderLoRA`): an adapter file's
   text-encoder parts act there, at each adapter's ``text_encoder_scale``, while the pipeline
   encodes its prompts (``lora_context(rows, component="text_encoder")``).
3. ``lora_backend="peft"``: every ``lora_path`` adapter is loaded and pinned, under the id
   ``stable_lora_int_id(path)`` (on a two-denoiser stage the i-th on the i-th denoiser, as the
   distill backend fuses it); a request that names it without a scale gets ``lora_scale``.

Every rank runs the same calls with the same arguments, so the caches of all ranks agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.lora import DiffusionLoRAManager, find_denoisers, fuse_lora_files_into_pipeline
from vllm_omni.diffusion.lora.text_encoder_lora import TextEncoderLoRA
from vllm_omni.errors import ConfigError, InvalidRequestError
from vllm_omni.lora.request import (
    LoRARequest,
    RequestAdapters,
    assign_denoisers,
    startup_lora_request,
)
from vllm_omni.lora.schedule import LoRAScaleSchedule

#: One request's adapters, each with its scale (``None``: the default applies): the typed value the
#: entry point built (:class:`~vllm_omni.lora.request.RequestAdapters`).
LoRASet = RequestAdapters


class WorkerLoRA:
    """Owns the LoRA managers of one worker and turns per-prompt adapter sets into activations.

    A stage with one denoiser has one :class:`DiffusionLoRAManager` over the pipeline. A stage with
    several (a Wan2.2-style MoE: ``transformer`` high noise, ``transformer_2`` low noise) has one
    manager per denoiser, each with ``max_loras`` slots and a ``max_cpu_loras`` host cache; every
    request adapter acts on the denoiser :func:`~vllm_omni.lora.request.assign_denoisers` gives it
    (its ``denoiser`` field, else ``[high_noise, low_noise]`` by position), the rule the distill
    backend applies to ``lora_path`` too.

    Args:
        pipeline: the loaded pipeline (``transformer`` / ``transformer_2`` are patched).
        od_config: the engine config (LoRA fields).

    Attributes:
        managers: denoiser attribute -> its :class:`DiffusionLoRAManager` (primary first).
        manager: the primary denoiser's manager.
        fused: for the distill backend, denoiser attribute -> fused layer names.
        startup_requests: the pinned ``lora_path`` adapters (PEFT backend).

    Raises:
        LoRAFormatError / FileNotFoundError / ValueError: a start-up adapter cannot be read or
            fused (the worker fails to start, naming the file).
        ConfigError: more ``lora_path`` files than denoisers on a stage with several.
    """

    def __init__(self, pipeline: Any, od_config: OmniDiffusionConfig):
        self.od_config = od_config
        self.label = f"the diffusion stage ({type(pipeline).__name__})"
        self.reports_steps = bool(getattr(pipeline, "reports_denoising_step", False))
        self.pipeline_name = type(pipeline).__name__
        paths = od_config.startup_lora_paths
        scale = float(od_config.lora_scale)
        self.fused: dict[str, list[str]] = {}
        if od_config.lora_backend == "distill" and paths:
            self.fused = fuse_lora_files_into_pipeline(pipeline, paths, [scale] * len(paths))
        denoisers = find_denoisers(pipeline)
        sizes = {
            "max_loras": od_config.max_loras,
            "max_rank": od_config.max_lora_rank,
            "max_cpu_loras": od_config.max_cpu_loras,
            "banks": od_config.compiles,  # a compiled denoiser reads fixed-shape banks (never recompiles)
            "merge": od_config.lora_merge,  # one adapter for a whole batch folded into the base weights
        }
        #: the text encoders' managers; their reader splits each file (text-encoder parts refused
        #: before anything is cached when the pipeline lacks that encoder)
        self.text_encoders = TextEncoderLoRA(
            pipeline, self.label, **{k: sizes[k] for k in ("max_loras", "max_rank", "max_cpu_loras")}
        )
        sizes["adapter_loader"] = self.text_encoders.read
        if len(denoisers) == 1:
            self.managers = {next(iter(denoisers)) or "transformer": DiffusionLoRAManager(pipeline, **sizes)}
        else:
            self.managers = {
                name: DiffusionLoRAManager(module, **sizes) for name, module in denoisers.items()
            }
        self.denoisers = list(self.managers)
        self.manager = self.managers[self.denoisers[0]]
        self.default_scales: dict[int, float] = {}
        self.startup_requests: list[LoRARequest] = []
        #: statistics not yet taken by :meth:`drain_events`: ``(event, adapter name, value)``
        self._events: list[tuple] = []  # ... and the engine id for loaded / evicted / unloaded / pinned
        self._names: dict[int, str] = {}
        if od_config.lora_backend == "peft":
            self._load_startup(paths, scale)

    def _load_startup(self, paths: Sequence[str], scale: float) -> None:
        """Pre-load and pin the ``lora_path`` adapters; on a stage with several denoisers the i-th on
        the i-th denoiser (the distill backend's rule), on one denoiser all of them."""
        if len(self.denoisers) > 1 and len(paths) > len(self.denoisers):
            raise ConfigError(
                f"{len(paths)} lora_path files for the denoisers {self.denoisers}: the i-th file acts on the "
                "i-th denoiser ([high_noise, low_noise]); pre-load other adapters with add_lora and name "
                "their denoiser per request"
            )
        for i, path in enumerate(paths):
            request = startup_lora_request(path)
            manager = self.managers[self.denoisers[i if len(self.denoisers) > 1 else 0]]
            self._name(request)
            self._loading([request], lambda m=manager, r=request: m.add_lora(r), False)
            manager.pin_lora(request.lora_int_id)
            self._events.append(("pinned", self._names[request.lora_int_id], 1, request.lora_int_id))
            self.default_scales[request.lora_int_id] = scale
            self.startup_requests.append(request)

    # ------------------------------------------------------------------ management
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load into the host cache of every denoiser (all or nothing); ``True`` if it was loaded now
        anywhere, ``False`` if every denoiser had it cached."""
        name = self._name(lora_request)
        try:
            return bool(self._loading([lora_request], lambda: self._add_everywhere(lora_request), False))
        except Exception:
            self._events.append(("registration_failures", name, 1))
            raise

    def _add_everywhere(self, lora_request: LoRARequest) -> bool:
        loaded: list[Any] = []
        try:
            for manager in self.managers.values():
                if manager.add_lora(lora_request):
                    loaded.append(manager)
            self.text_encoders.note_loaded([lora_request])
            for name in self.text_encoders.users(lora_request):
                if self.text_encoders.managers[name].add_lora(lora_request):
                    loaded.append(self.text_encoders.managers[name])
        except BaseException:
            for manager in loaded:
                manager.remove_lora(lora_request.lora_int_id)
            raise
        finally:
            self.text_encoders.done_loading()
        return bool(loaded)

    def _every_manager(self) -> list[DiffusionLoRAManager]:
        return [*self.managers.values(), *self.text_encoders.managers.values()]

    def _manager(self, name: str) -> DiffusionLoRAManager:
        return self.managers[name] if name in self.managers else self.text_encoders.managers[name]

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop from every denoiser's cache and slots; ``False`` when none had it. ``LoRACacheError``
        (nothing removed) while a request holds it on any denoiser."""
        holders = [m for m in self._every_manager() if m.cache_entry(lora_int_id) is not None]
        for manager in holders:
            entry = manager.cache_entry(lora_int_id)
            if entry.refcount > 0 or lora_int_id in manager.active_lora_ids:
                manager.remove_lora(lora_int_id)  # raises the manager's LoRACacheError
        for manager in holders:
            manager.remove_lora(lora_int_id)
        self.default_scales.pop(lora_int_id, None)
        self.text_encoders.components.pop(lora_int_id, None)
        if holders:
            self._events.append(("unloaded", self._names.get(lora_int_id, str(lora_int_id)), 0, lora_int_id))
        return bool(holders)

    def list_loras(self) -> list[int]:
        """Cached adapter ids (any denoiser), least recently used first on the primary denoiser."""
        return list(dict.fromkeys(i for m in self.managers.values() for i in m.list_loras()))

    def pin_lora(self, lora_int_id: int) -> bool:
        """Pin a cached adapter on every denoiser that holds it (``InvalidRequestError`` when none does)."""
        holders = [m for m in self._every_manager() if m.cache_entry(lora_int_id) is not None]
        if not holders:
            return self.manager.pin_lora(lora_int_id)  # raises: not cached
        pinned = all(m.pin_lora(lora_int_id) for m in holders)
        self._events.append(("pinned", self._names.get(lora_int_id, str(lora_int_id)), 1, lora_int_id))
        return pinned

    # ------------------------------------------------------------------ statistics
    def _name(self, lora: LoRARequest) -> str:
        name = self._names[lora.lora_int_id] = lora.lora_name or str(lora.lora_int_id)
        return name

    def _loading(self, requests: Sequence[LoRARequest], load: Callable[[], Any], for_request: bool) -> Any:
        """Run ``load`` (which may read ``requests`` into the host caches) and note what it did: cache
        hits and misses (``for_request``: a request needs them), load seconds (a call that loaded several
        adapters splits its time evenly) and the adapters it evicted (from every denoiser)."""
        before = set(self.list_loras())
        start = time.perf_counter()
        result = load()
        seconds = time.perf_counter() - start
        after = set(self.list_loras())
        missed = {r.lora_int_id: self._name(r) for r in requests if r.lora_int_id not in before}
        for lora in requests:
            hit = lora.lora_int_id not in missed
            if for_request:
                self._events.append(("cache_hits" if hit else "cache_misses", self._name(lora), 1))
        for lora_int_id, name in missed.items():  # each version under its engine id
            self._events.append(("loaded", name, seconds / len(missed), lora_int_id))
        for lora_int_id in before - after:
            self._events.append(("evicted", self._names.get(lora_int_id, str(lora_int_id)), 1, lora_int_id))
        return result

    def note_batch(self, sets: Sequence[LoRASet]) -> None:
        """Count a denoiser batch's device-slot hits and misses (once per distinct adapter; resident on
        any denoiser counts as a hit)."""
        resident = {i for m in self.managers.values() for i in m.slot_assignment()}
        for lora in {a.lora.lora_int_id: a.lora for s in sets for a in s}.values():
            hit = lora.lora_int_id in resident
            self._events.append(("slot_hits" if hit else "slot_misses", self._name(lora), 1))

    def note_steps(self, seconds: Sequence[float]) -> None:
        """Record the seconds of each denoising step of a batch (event ``step``)."""
        self._events.extend(("step", "", float(t)) for t in seconds)

    def drain_events(self) -> list[tuple]:
        """The statistics events since the last call, oldest first (see ``StatsRecorder.apply``)."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ requests
    def targets(self, adapters: LoRASet) -> list[str]:
        """The denoiser of each adapter (:func:`~vllm_omni.lora.request.assign_denoisers`)."""
        return assign_denoisers(adapters, self.denoisers, self.label)

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

    def check_schedules(self, adapters: LoRASet, targets: Sequence[str]) -> None:
        """Refuse schedules this stage cannot run, before any adapter is loaded.

        Raises:
            InvalidRequestError: a per-step schedule on a pipeline that does not report its steps.
            InvalidAdapterError: a block pattern or index that matches no LoRA layer of its denoiser.
        """
        for a, target in zip(adapters, targets, strict=True):
            if not isinstance(a.scale, LoRAScaleSchedule):
                continue
            where = f"scale of LoRA {a.lora.lora_int_id} ({a.lora.lora_name!r})"
            if a.scale.varies_with_step and not self.reports_steps:
                raise InvalidRequestError(
                    f"{where}: per-step scales need a pipeline that reports its denoising steps "
                    f"(in-tree pipelines); {self.pipeline_name} does not"
                )
            self.managers[target].block_factors(a.scale, where)

    def acquire(self, adapters: LoRASet) -> list[tuple[str, list[int]]]:
        """Check a request's targets and schedules, then load (if needed) and hold its adapters on their
        denoisers; nothing changes on failure (see :meth:`targets` and :meth:`check_schedules`).

        Returns:
            ``[(denoiser, held ids)]``, for :meth:`release`.
        """
        if not adapters:
            return []
        targets = self.targets(adapters)
        self.check_schedules(adapters, targets)
        held: list[tuple[str, list[int]]] = []

        def load() -> None:
            for name in dict.fromkeys(targets):
                loras = [a.lora for a, t in zip(adapters, targets, strict=True) if t == name]
                held.append((name, self.managers[name].acquire_loras(loras)))
            self.text_encoders.note_loaded([a.lora for a in adapters])
            for name, manager in self.text_encoders.managers.items():
                loras = [a.lora for a in adapters if name in self.text_encoders.users(a.lora)]
                if loras:
                    held.append((name, manager.acquire_loras(loras)))

        before = set(self.list_loras())
        try:
            self._loading([a.lora for a in adapters], load, True)
        except BaseException:
            self.release(held)
            for lora_int_id in {a.lora.lora_int_id for a in adapters} - before:
                self.remove_lora(lora_int_id)  # a text-encoder part failed: nothing stays cached
            raise
        finally:
            self.text_encoders.done_loading()
        return held

    def release(self, held: Sequence[tuple[str, list[int]]]) -> None:
        for name, ids in held:
            if ids:
                self._manager(name).release_loras(ids)

    def context_factory(
        self, sets: Sequence[LoRASet]
    ) -> Callable[[list[int] | None], AbstractContextManager]:
        """The ``lora_context`` callback for a pipeline call whose i-th prompt uses ``sets[i]``.

        The callback receives the prompt index of every denoiser sample (CFG copies included)
        and activates, on each denoiser, a per-sample scale matrix of the adapters that act on it;
        with ``None`` (a pipeline that cannot report its layout) every prompt must share one set,
        which is then applied to the whole batch. With ``component="text_encoder"`` it activates the
        adapters' text-encoder parts instead, on every text encoder, for an encoder batch whose
        sequences belong to the given prompts (negative prompts included), each at its
        ``text_encoder_scale`` (default: its scale; a schedule's: the stage default).

        Raises (from the callback):
            ValueError: ``None`` layout but the prompts' sets differ.
        """
        per_prompt = [self._per_denoiser(adapters) for adapters in sets]
        used = [name for name in self.denoisers if any(p[name] for p in per_prompt)]

        def make(
            sample_prompts: list[int] | None, lora_scale: float = 1.0, component: str = "transformer"
        ) -> AbstractContextManager:
            if component == "text_encoder":
                return self._text_encoder_context(sets, sample_prompts, lora_scale)
            if component != "transformer":
                raise ValueError(
                    f"lora_context component must be 'transformer' or 'text_encoder', got {component!r}"
                )
            if not used:
                return contextlib.nullcontext()
            table = per_prompt
            if lora_scale != 1.0:  # a call-wide LoRA scale multiplies every adapter's
                table = [{n: _scaled(s, lora_scale) for n, s in p.items()} for p in per_prompt]
            if sample_prompts is None:
                if len({tuple((n, _key(p[n])) for n in used) for p in table}) != 1:
                    raise ValueError(
                        "this pipeline runs one LoRA set per call; got prompts with different sets"
                    )
                return _activate_all([(self.managers[n], table[0][n]) for n in used])
            return _activate_all([(self.managers[n], [table[i][n] for i in sample_prompts]) for n in used])

        return make

    def _per_denoiser(self, adapters: LoRASet) -> dict[str, RequestAdapters]:
        """``{denoiser: its adapters of this request}``, each at the scale that applies (stage defaults
        resolved, :meth:`resolve_scales`)."""
        targets = self.targets(adapters) if adapters else []
        scales = self.resolve_scales(adapters)
        return {
            name: RequestAdapters(
                tuple(
                    dataclasses.replace(a, scale=s)
                    for a, s, t in zip(adapters, scales, targets, strict=True)
                    if t == name
                )
            )
            for name in self.denoisers
        }

    def _text_encoder_context(
        self, sets: Sequence[LoRASet], rows: list[int] | None, lora_scale: float
    ) -> AbstractContextManager:
        """The text encoders' activation for prompts using ``sets`` (see :meth:`context_factory`)."""
        if not self.text_encoders.managers or not any(
            self.text_encoders.users(a.lora) for adapters in sets for a in adapters
        ):
            return contextlib.nullcontext()
        prompts = []
        for adapters in sets:
            scales = self.resolve_scales(adapters)
            items = []
            for a, scale in zip(adapters, scales, strict=True):
                if a.text_encoder_scale is not None:
                    scale = a.text_encoder_scale
                elif isinstance(scale, LoRAScaleSchedule):
                    scale = self.default_scales.get(a.lora.lora_int_id, 1.0)
                items.append(dataclasses.replace(a, scale=float(scale) * lora_scale))
            prompts.append(RequestAdapters(tuple(items)))
        return self.text_encoders.activate(prompts, rows)


@contextlib.contextmanager
def _activate_all(parts: Sequence[tuple[Any, Any]]) -> Iterator[None]:
    """Activate ``(manager, adapters)`` on each denoiser for the block (``adapters``: one
    ``RequestAdapters`` for every sample, or one per sample); a failure on one deactivates those already
    activated."""
    with contextlib.ExitStack() as stack:
        for manager, adapters in parts:
            stack.enter_context(manager.activate_adapters(adapters))
        yield


def _key(adapters: RequestAdapters) -> tuple:
    """What makes two prompts' adapters on one denoiser the same activation: ids and scales."""
    return tuple((a.lora.lora_int_id, a.scale) for a in adapters)


def _scaled(adapters: RequestAdapters, factor: float) -> RequestAdapters:
    """``adapters`` with every scale multiplied by ``factor`` (:func:`_times`)."""
    return RequestAdapters(tuple(dataclasses.replace(a, scale=_times(a.scale, factor)) for a in adapters))


def _times(value: float | LoRAScaleSchedule, factor: float) -> float | LoRAScaleSchedule:
    """``value * factor`` for a scale; a schedule's step scales are multiplied (its block multipliers
    stay), as diffusers' ``scale_lora_layers`` multiplies whatever scale each adapter has."""
    if not isinstance(value, LoRAScaleSchedule):
        return value * factor
    return value.times(factor)
