"""Which device slots apply to which rows of the current batch, with which scales.

The manager publishes one :class:`SlotActivation` per active slot into the :class:`LoRABatchState`
shared by all its layers; the layers read it in ``forward``. Rows are addressed by host-side runs
``(start, length, scale)`` over the leading dimension, so a mixed batch needs no gather / scatter
and no device index tensors.

Scale schedules (:mod:`vllm_omni.lora.schedule`) only change this activation, never slot contents:
per-block multipliers become per-layer activations (``overrides``, shared by the layers with the same
multipliers), and per-step scales are re-published by the manager's step hook when the forward
context reports a new denoising step (:meth:`LoRABatchState.slots_for`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_omni.diffusion.forward_context import get_forward_context

if TYPE_CHECKING:
    from vllm_omni.diffusion.lora.weights import SlotWeights


@dataclass(frozen=True)
class SlotActivation:
    """How one device slot applies to the current batch.

    Attributes:
        slot: device slot index.
        scale: the common scale of the samples it applies to when they share one, else ``None``.
        column: the slot's scale for every sample of the batch (``0.0``: not applied).
        runs: ``(start, length, scale)`` runs of consecutive rows sharing a non-zero scale, or
            ``None`` when the slot applies to every row with ``scale``.
    """

    slot: int
    scale: float | None
    column: tuple[float, ...] = field(default=(), compare=False)
    runs: tuple[tuple[int, int, float], ...] | None = field(default=None, compare=False)


def scale_runs(
    values: Sequence[float], lengths: Sequence[int] | None = None
) -> tuple[tuple[int, int, float], ...]:
    """``(start, length, scale)`` runs of the rows with a non-zero scale.

    ``values`` holds one scale per sample; ``lengths`` (optional) the number of rows of each sample
    (default one). Consecutive samples with the same scale are merged into one run.
    """
    runs: list[tuple[int, int, float]] = []
    start = 0
    for n, value in enumerate(values):
        length = 1 if lengths is None else int(lengths[n])
        if value != 0.0 and length:
            if runs and runs[-1][2] == value and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + length, value)
            else:
                runs.append((start, length, float(value)))
        start += length
    return tuple(runs)


class LoRABatchState:
    """Activation shared by every layer of one manager (set by the manager, read in forward).

    Attributes:
        batch_size: samples of the activation (``0``: one request broadcast to every row).
        slots: the active slots.
        stacked: per layer (``id``), the active adapters stacked into one :class:`SlotWeights`
            (see :func:`.ops.stack_slot_weights`); built on first use, dropped with the activation.
        uniform: every one of several active slots applies to every row with one scale, so the
            layers may stack them.
        overrides: per layer (``id``) whose block multipliers are not all ``1``, its own
            ``(slots, uniform)``.
        on_step: set while a schedule varies with the step: called with ``(step, num_steps)`` of the
            forward context on the first layer call of a new step; it publishes that step's scales.
        bank_on: some slot has a non-zero scale for some row (read by compiled regions: the one
            Python decision they make, so a compiled denoiser has one graph without LoRA and one with).
        force_bank: set by the compile warm-up (:mod:`vllm_omni.diffusion.compile_warmup`): compiled
            regions take the bank path with no adapter active (an all-zero scale table: a delta of
            exact zeros), so the LoRA graphs compile before the first adapter arrives.
    """

    def __init__(self) -> None:
        self.batch_size: int = 0
        self.slots: tuple[SlotActivation, ...] = ()
        self._ragged: dict[tuple[int, tuple[int, ...]], SlotActivation] = {}
        self.stacked: dict[int, SlotWeights | None] = {}
        self.uniform = False
        self.overrides: dict[int, tuple[tuple[SlotActivation, ...], bool]] = {}
        #: while a step hook is set: per (layer, slots) the unscaled stack and its row segments
        #: (kept across steps), and per layer this step's row scales (dropped with each publication)
        self.unit_stacked: dict[tuple[int, tuple[int, ...]], tuple] = {}
        self.row_scales: dict[int, object] = {}
        self.on_step: Callable[[int | None, int | None], None] | None = None
        self._step: tuple[int | None, int | None] | None = None
        self.force_bank = False
        self.bank_on = False

    def set(
        self,
        batch_size: int,
        slots: tuple[SlotActivation, ...],
        overrides: dict[int, tuple[SlotActivation, ...]] | None = None,
    ) -> None:
        """Publish a new activation (drops what was derived from the previous one).

        ``overrides`` maps a layer (``id``) to its own activation (block multipliers applied).
        """
        self.batch_size = batch_size
        self.slots = slots
        self._ragged = {}
        self.stacked = {}
        self.row_scales = {}
        self.uniform = _uniform(slots)
        self.bank_on = bool(slots) or self.force_bank
        self.overrides = {key: (acts, _uniform(acts)) for key, acts in (overrides or {}).items()}

    def clear(self) -> None:
        """No slot applies (and no step hook)."""
        self.set(0, ())
        self.set_step_hook(None)

    def set_step_hook(self, hook: Callable[[int | None, int | None], None] | None) -> None:
        """Install (or remove, ``None``) the hook that publishes a step's scales; it runs on the next call."""
        self.on_step = hook
        self._step = None
        self.unit_stacked = {}

    def slots_for(self, layer: object) -> tuple[tuple[SlotActivation, ...], bool]:
        """``(slots, uniform)`` of ``layer``: its override, else the shared activation.

        First brings the activation to the forward context's denoising step when a step hook is set.
        """
        self.sync_step()
        if self.overrides:
            own = self.overrides.get(id(layer))
            if own is not None:
                return own
        return self.slots, self.uniform

    def sync_step(self) -> None:
        """Publish the forward context's step's scales if a step hook is set and the step changed
        (layers call it; a compiled region's runner calls it before the region, which cannot)."""
        if self.on_step is not None:
            ctx = get_forward_context()
            step = (ctx.step, ctx.num_steps)
            if step != self._step:
                self.on_step(*step)
                self._step = step

    def for_rows(self, act: SlotActivation, leading: int) -> SlotActivation:
        """``act`` re-expressed for an input whose leading dimension is ``leading``.

        An input with one row per sample uses ``act`` as is; one whose rows concatenate the
        samples' rows is mapped through the row layout the model declared in the forward context
        (:func:`vllm_omni.diffusion.forward_context.rows_per_sample`).

        Raises:
            RuntimeError: per-sample scales differ but the rows cannot be attributed to samples.
        """
        if act.runs is None or leading == self.batch_size:
            return act
        lengths = get_forward_context().rows_per_sample
        if lengths is None or len(lengths) != self.batch_size or sum(lengths) != leading:
            raise RuntimeError(
                f"LoRA batch mixes adapter scales across {self.batch_size} samples but this layer got input "
                f"with leading dimension {leading}; pass one entry per sample of the forward batch, or wrap "
                "ragged inputs in lora_rows_per_sample(lengths)"
            )
        key = (id(act), lengths)  # acts live as long as the activation that holds them
        cached = self._ragged.get(key)
        if cached is None:
            cached = SlotActivation(act.slot, act.scale, act.column, scale_runs(act.column, lengths))
            self._ragged[key] = cached
        return cached


def _uniform(slots: tuple[SlotActivation, ...]) -> bool:
    return len(slots) > 1 and all(a.runs is None for a in slots)
