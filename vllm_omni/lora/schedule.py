"""Per-step and per-block scale schedules of one adapter in one diffusion request.

An adapter's scale in a request is a number, or a :class:`LoRAScaleSchedule` that varies it

* with the denoising step (``steps``): one value per step, or piecewise ranges of the step
  fraction (:class:`ScaleRange`); and
* with the denoiser block (``blocks``): module-name glob patterns or block indices mapped to a
  multiplier of the step scale (like diffusers' per-block ``set_adapters`` weights).

Step convention: step ``i`` of ``N`` (``i = 0 .. N-1``, the ``i`` that diffusers passes to
``callback_on_step_end`` after the step, i.e. the index in ``enumerate(scheduler.timesteps)``) has the
step fraction ``i / N``. A list gives step ``i`` its ``i``-th value; ranges give it the scale of the
range ``[start, end)`` holding ``i / N``. Ranges must cover ``[0, 1]`` without gaps or overlaps.

Block convention: a pattern (``fnmatch`` glob) applies to a LoRA layer whose qualified name (e.g.
``layers.3.attention.to_qkv``; a second denoiser's names start with ``transformer_2.``) it matches, or
one of whose dotted prefixes it matches (``layers.3`` covers the whole block). An integer key ``k``
(or a string of digits, as JSON keys are) means the ``k``-th block of the denoiser's main block list
(``layers.k`` on Z-Image). When several entries match a layer the last one wins; layers no entry
matches keep multiplier ``1``. The effective scale of a layer at step ``i`` is
``step_scale(i) * multiplier(layer)``.

Every value (step scales, range scales, multipliers and their products) is a finite number within
``[-MAX_ADAPTER_SCALE, MAX_ADAPTER_SCALE]``, the limit of constant scales.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_omni.errors import InvalidAdapterError, InvalidRequestError

#: The largest ``|scale|`` one adapter may have in one request, on every path (Python
#: ``lora_scales`` / ``OmniDiffusionSamplingParams`` and the HTTP ``lora`` field), schedules included
#: (re-exported by :mod:`vllm_omni.lora.request`). Beyond it an adapter's delta dwarfs the base
#: weights, which is never a useful setting and easily overflows.
MAX_ADAPTER_SCALE = 100.0
#: The longest per-step list / range list / block map accepted (bounds the work of one request).
MAX_SCHEDULE_ITEMS = 1000

__all__ = ["LoRAScaleSchedule", "MAX_ADAPTER_SCALE", "ScaleRange", "coerce_scale", "step_fraction"]


def step_fraction(step: int, num_steps: int) -> float:
    """``step / num_steps``: the fraction of denoising done before step ``step`` (0-based)."""
    return step / num_steps


def coerce_number(value: Any, where: str) -> float:
    """A plain scale: a finite int or float within the scale limits, as ``float``.

    Raises:
        InvalidRequestError: anything else (naming ``where``).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        value = f"a {type(value).__name__}"
    else:
        try:
            value = float(value)
        except OverflowError:  # an integer beyond the float range
            value = math.inf
    if not isinstance(value, float) or not math.isfinite(value) or abs(value) > MAX_ADAPTER_SCALE:
        raise InvalidRequestError(
            f"{where} must be a finite number in [-{MAX_ADAPTER_SCALE:g}, {MAX_ADAPTER_SCALE:g}], got {value!r:.50}"
        )
    return value


@dataclass(frozen=True)
class ScaleRange:
    """The scale over the step fractions ``[start, end)`` (the last range also holds ``1.0``)."""

    start: float
    end: float
    scale: float


@dataclass(frozen=True)
class LoRAScaleSchedule:
    """How one adapter's scale varies over the steps and blocks of a request (hashable).

    Attributes:
        steps: ``None`` (the adapter's default scale: ``1.0`` or the stage's ``lora_scale``), a number,
            a tuple with one number per denoising step, or a tuple of :class:`ScaleRange` covering
            ``[0, 1]`` in order.
        blocks: ``(pattern or block index, multiplier)`` pairs, in order (see the module doc).

    Build one from the public forms with :meth:`parse` (lists and dicts are accepted too).
    """

    steps: float | tuple[float, ...] | tuple[ScaleRange, ...] | None = None
    blocks: tuple[tuple[str | int, float], ...] = ()

    def __post_init__(self) -> None:
        steps = self.steps
        if isinstance(steps, list):
            object.__setattr__(self, "steps", tuple(steps))
        if isinstance(self.blocks, Mapping):
            object.__setattr__(self, "blocks", tuple(self.blocks.items()))
        elif isinstance(self.blocks, list):
            object.__setattr__(self, "blocks", tuple(tuple(b) for b in self.blocks))

    # ------------------------------------------------------------------ parsing
    @classmethod
    def parse(cls, value: Any, where: str = "scale") -> LoRAScaleSchedule:
        """A schedule from a list (per-step values or ranges), a ``{"steps", "blocks"}`` dict or a schedule.

        Raises:
            InvalidRequestError: a wrong type, key or value, or an empty schedule (``{}``, ``[]``,
                ``{"steps": []}``, ``{"blocks": {}}``: none of them says a scale); the message starts
                with ``where``.
        """
        if isinstance(value, LoRAScaleSchedule):
            steps, blocks = value.steps, value.blocks
        elif isinstance(value, Mapping):
            unknown = sorted(str(k) for k in value if k not in ("steps", "blocks"))
            if unknown:
                raise InvalidRequestError(
                    f"{where} has unknown key(s) {unknown}; allowed: ['steps', 'blocks']"
                )
            steps, blocks = value.get("steps"), value.get("blocks") or ()
        elif isinstance(value, list | tuple):
            steps, blocks = tuple(value), ()
        else:
            raise InvalidRequestError(
                f"{where} must be a number, a list or {{'steps': ..., 'blocks': {{...}}}}, got {type(value).__name__}"
            )
        schedule = cls(
            _parse_steps(steps, f"{where}.steps" if isinstance(value, Mapping) else where),
            _parse_blocks(blocks, f"{where}.blocks"),
        )
        if schedule.steps is None and not schedule.blocks:
            raise InvalidRequestError(
                f"{where} is an empty schedule; give a number, a list of per-step values or ranges, "
                "or {'steps': ..., 'blocks': {...}} with at least one of them (omit the scale for the default)"
            )
        schedule._check_products(where)
        return schedule

    def _check_products(self, where: str) -> None:
        peak = max((abs(m) for _, m in self.blocks), default=1.0)
        top = max((abs(v) for v in self.step_values()), default=1.0)
        if top * peak > MAX_ADAPTER_SCALE:
            raise InvalidRequestError(
                f"{where}: a step scale times a block multiplier reaches {top * peak:g}, beyond the limit "
                f"{MAX_ADAPTER_SCALE:g}"
            )

    # ------------------------------------------------------------------ queries
    def step_values(self) -> tuple[float, ...]:
        """Every step scale the schedule can take (empty for ``steps=None``)."""
        steps = self.steps
        if steps is None:
            return ()
        if isinstance(steps, int | float):
            return (float(steps),)
        return tuple(r.scale if isinstance(r, ScaleRange) else float(r) for r in steps)

    @property
    def varies_with_step(self) -> bool:
        """Whether ``steps`` is a list or ranges (the pipeline must report its denoising step)."""
        return isinstance(self.steps, tuple)

    def check_steps(self, num_steps: int, where: str = "scale") -> None:
        """Refuse a per-step list whose length is not ``num_steps``.

        Raises:
            InvalidRequestError: naming ``where`` and both lengths.
        """
        steps = self.steps
        if (
            isinstance(steps, tuple)
            and steps
            and not isinstance(steps[0], ScaleRange)
            and len(steps) != num_steps
        ):
            raise InvalidRequestError(
                f"{where} has {len(steps)} per-step values but num_inference_steps is {num_steps}; "
                "give one value per step, or ranges of the step fraction"
            )

    def scale_at(self, step: int | None, num_steps: int | None, default: float = 1.0) -> float:
        """The step scale (before block multipliers) at ``step`` of ``num_steps``.

        ``default`` stands for ``steps=None``. A constant schedule needs no step (``None``).

        Raises:
            InvalidRequestError: the schedule varies with the step but ``step`` is ``None``, or a
                per-step list does not have ``num_steps`` values.
        """
        steps = self.steps
        if steps is None:
            return default
        if not isinstance(steps, tuple):
            return float(steps)
        if step is None or num_steps is None:
            raise InvalidRequestError(
                "a per-step LoRA scale needs a pipeline that reports its denoising step; this one does not"
            )
        if not isinstance(steps[0], ScaleRange):
            self.check_steps(num_steps)
            return float(steps[step])
        fraction = step_fraction(step, num_steps)
        for r in steps:
            if r.start <= fraction < r.end:
                return r.scale
        return steps[-1].scale  # fraction 1.0 only

    def with_default(self, default: float) -> LoRAScaleSchedule:
        """This schedule with ``steps=None`` replaced by the number ``default``."""
        return self if self.steps is not None else LoRAScaleSchedule(float(default), self.blocks)

    def times(self, factor: float) -> LoRAScaleSchedule:
        """This schedule with every step scale multiplied by ``factor`` (block multipliers unchanged);
        resolve ``steps=None`` with :meth:`with_default` first (it is taken as ``1.0`` here)."""
        steps = self.steps
        if steps is None or isinstance(steps, int | float):
            scaled: Any = (1.0 if steps is None else float(steps)) * factor
        else:
            scaled = tuple(
                ScaleRange(r.start, r.end, r.scale * factor)
                if isinstance(r, ScaleRange)
                else float(r) * factor
                for r in steps
            )
        return LoRAScaleSchedule(scaled, self.blocks)

    def block_factors(
        self, layer_names: Iterable[str], block_list: str | None, where: str = "scale"
    ) -> dict[str, float]:
        """Per LoRA layer its block multiplier, for the layers whose multiplier is not ``1``.

        Args:
            layer_names: the qualified names of the model's LoRA layers.
            block_list: the name of the denoiser's main block list (``"layers"``), for integer keys.
            where: the public name of this scale, for messages.

        Raises:
            InvalidAdapterError: a pattern (or block index) matches no LoRA layer of the model, or an
                integer key on a model without a block list.
        """
        names = list(layer_names)
        factors: dict[str, float] = {}
        for key, multiplier in self.blocks:
            if isinstance(key, int):
                if block_list is None:
                    raise InvalidAdapterError(
                        f"{where}: blocks key {key} is a block index but this model has no block list"
                    )
                pattern = f"{block_list}.{key}"
            else:
                pattern = key
            hits = [n for n in names if _matches(n, pattern)]
            if not hits:
                raise InvalidAdapterError(
                    f"{where}: blocks pattern {key!r} matches no LoRA layer of the model "
                    f"(e.g. {', '.join(sorted(names)[:4])})"
                )
            for name in hits:
                factors[name] = multiplier
        return {n: m for n, m in factors.items() if m != 1.0}


def _matches(name: str, pattern: str) -> bool:
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(len(parts), 0, -1))


def _parse_steps(steps: Any, where: str) -> float | tuple[float, ...] | tuple[ScaleRange, ...] | None:
    if steps is None:
        return None
    if not isinstance(steps, list | tuple):
        return coerce_number(steps, where)
    if not steps or len(steps) > MAX_SCHEDULE_ITEMS:
        raise InvalidRequestError(f"{where} must hold 1 to {MAX_SCHEDULE_ITEMS} entries, got {len(steps)}")
    if all(isinstance(s, Mapping | ScaleRange) for s in steps):
        return _parse_ranges(steps, where)
    return tuple(coerce_number(v, f"{where}[{i}]") for i, v in enumerate(steps))


def _parse_ranges(items: Sequence[Any], where: str) -> tuple[ScaleRange, ...]:
    ranges = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if isinstance(item, ScaleRange):
            item = {"start": item.start, "end": item.end, "scale": item.scale}
        missing = [k for k in ("start", "end", "scale") if k not in item]
        unknown = sorted(str(k) for k in item if k not in ("start", "end", "scale"))
        if missing or unknown:
            raise InvalidRequestError(
                f"{at} must have exactly the keys 'start', 'end', 'scale' (missing "
                f"{missing}, unknown {unknown})"
            )
        start, end = (coerce_number(item[k], f"{at}.{k}") for k in ("start", "end"))
        if not 0.0 <= start < end <= 1.0:
            raise InvalidRequestError(f"{at} needs 0 <= start < end <= 1, got start={start:g} end={end:g}")
        ranges.append(ScaleRange(start, end, coerce_number(item["scale"], f"{at}.scale")))
    ranges.sort(key=lambda r: r.start)
    edge = 0.0
    for r in ranges:
        if r.start != edge:
            what = "overlap" if r.start < edge else "leave a gap"
            raise InvalidRequestError(
                f"{where}: ranges must cover [0, 1] without gaps or overlaps; they {what} at {min(r.start, edge):g}"
            )
        edge = r.end
    if edge != 1.0:
        raise InvalidRequestError(f"{where}: ranges must cover [0, 1]; they end at {edge:g}")
    return tuple(ranges)


def _parse_blocks(blocks: Any, where: str) -> tuple[tuple[str | int, float], ...]:
    if isinstance(blocks, Mapping):
        items = list(blocks.items())
    elif isinstance(blocks, list | tuple):
        items = [tuple(b) if isinstance(b, list | tuple) else b for b in blocks]
        if not all(isinstance(b, tuple) and len(b) == 2 for b in items):
            raise InvalidRequestError(f"{where} must map patterns or block indices to multipliers")
    else:
        raise InvalidRequestError(f"{where} must be an object mapping patterns to multipliers")
    if len(items) > MAX_SCHEDULE_ITEMS:
        raise InvalidRequestError(f"{where} has more than {MAX_SCHEDULE_ITEMS} entries")
    out: list[tuple[str | int, float]] = []
    for key, multiplier in items:
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if isinstance(key, bool) or not (
            isinstance(key, int) and key >= 0 or isinstance(key, str) and key.strip()
        ):
            raise InvalidRequestError(
                f"{where}: key {key!r} must be a module-name pattern or a block index >= 0"
            )
        out.append((key, coerce_number(multiplier, f"{where}[{key!r}]")))
    return tuple(out)


def coerce_scale(value: Any, where: str) -> float | LoRAScaleSchedule | None:
    """One adapter's public scale as ``None``, a ``float`` or a :class:`LoRAScaleSchedule`.

    Raises:
        InvalidRequestError: see :meth:`LoRAScaleSchedule.parse`; a plain number outside the limits.
    """
    if value is None:
        return None
    if isinstance(value, LoRAScaleSchedule | Mapping | list | tuple):
        return LoRAScaleSchedule.parse(value, where)
    return coerce_number(value, where)
