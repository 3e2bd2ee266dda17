"""Per-forward metadata of a diffusion denoiser call, owned by the runtime.

Like ``vllm.forward_context``: the runtime (a pipeline's denoising loop) sets the context around the
denoiser call; layers that need batch metadata (the LoRA layers) read it; models only *declare* what
only they know, without importing the code that consumes it.

The context carries the denoising step in progress (set by the runtime around each denoiser call,
:func:`denoising_step`; read by per-step LoRA scale schedules) and the row layout of ragged inputs. A model that runs a layer on the samples'
rows concatenated (``[sum(lengths), d]`` instead of ``[batch, ...]``, e.g. patch / caption embedders)
wraps that call so per-sample layer logic (a mixed LoRA batch) knows which rows belong to which
sample::

    with rows_per_sample([f.shape[0] for f in feats]):
        x = embedder(torch.cat(feats))

Contexts nest and are thread-local; leaving a block restores the enclosing one.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class DiffusionForwardContext:
    """Metadata of the denoiser call in progress.

    Attributes:
        rows_per_sample: rows of each sample when the current layer inputs concatenate the samples'
            rows (set by the model around such a call), else ``None``.
        step: 0-based index of the denoising step in progress (the ``i`` of
            ``enumerate(scheduler.timesteps)``, as diffusers passes it to ``callback_on_step_end``),
            or ``None`` when the runtime does not report steps.
        num_steps: the number of denoising steps of the loop (``None`` with ``step``).
    """

    rows_per_sample: tuple[int, ...] | None = None
    step: int | None = None
    num_steps: int | None = None


_EMPTY = DiffusionForwardContext()
_LOCAL = threading.local()


def get_forward_context() -> DiffusionForwardContext:
    """The context of the denoiser call in progress on this thread (an empty one outside any)."""
    return getattr(_LOCAL, "context", _EMPTY)


@contextmanager
def _override(**changes) -> Iterator[DiffusionForwardContext]:
    previous = get_forward_context()
    context = dataclasses.replace(previous, **changes)
    _LOCAL.context = context
    try:
        yield context
    finally:
        _LOCAL.context = previous


@contextmanager
def set_forward_context() -> Iterator[DiffusionForwardContext]:
    """Run a denoiser call (or a whole denoising loop) in a fresh context (runtime side).

    Nothing declared by an enclosing block leaks into it; the model fills it during the call.
    """
    with _override(rows_per_sample=None, step=None, num_steps=None) as ctx:
        yield ctx


@contextmanager
def denoising_step(step: int, num_steps: int) -> Iterator[DiffusionForwardContext]:
    """Declare the denoising step of the denoiser call(s) inside this block (runtime side).

    Args:
        step: 0-based step index, ``0 <= step < num_steps``.
        num_steps: steps of the whole loop.
    """
    start = time.perf_counter()
    with _override(step=int(step), num_steps=int(num_steps)) as ctx:
        yield ctx
    times = getattr(_LOCAL, "step_times", None)
    if times is not None:
        times.append(time.perf_counter() - start)


@contextmanager
def time_denoising_steps() -> Iterator[list[float]]:
    """Collect the wall-clock seconds of every :func:`denoising_step` block run on this thread
    inside this one (the runtime's statistics; on CUDA a step's kernels may finish in a later one)."""
    times: list[float] = []
    previous = getattr(_LOCAL, "step_times", None)
    _LOCAL.step_times = times
    try:
        yield times
    finally:
        _LOCAL.step_times = previous


@contextmanager
def rows_per_sample(lengths: Sequence[int]) -> Iterator[DiffusionForwardContext]:
    """Declare that layer inputs inside this block concatenate the samples' rows (model side).

    Args:
        lengths: rows of each sample, in batch order (``sum(lengths)`` is the inputs' leading size).

    Only consulted by a layer whose input's leading dimension differs from the batch size; costs
    nothing otherwise.
    """
    with _override(rows_per_sample=tuple(int(n) for n in lengths)) as ctx:
        yield ctx


__all__ = [
    "DiffusionForwardContext",
    "denoising_step",
    "get_forward_context",
    "rows_per_sample",
    "set_forward_context",
    "time_denoising_steps",
]
