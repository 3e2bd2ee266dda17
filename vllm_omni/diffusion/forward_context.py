"""Per-forward metadata of a diffusion denoiser call, owned by the runtime.

Like ``vllm.forward_context``: the runtime (a pipeline's denoising loop) sets the context around the
denoiser call; layers that need batch metadata (the LoRA layers) read it; models only *declare* what
only they know, without importing the code that consumes it.

The context carries the row layout of ragged inputs. A model that runs a layer on the samples'
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class DiffusionForwardContext:
    """Metadata of the denoiser call in progress.

    Attributes:
        rows_per_sample: rows of each sample when the current layer inputs concatenate the samples'
            rows (set by the model around such a call), else ``None``.
    """

    rows_per_sample: tuple[int, ...] | None = None


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
    with _override(rows_per_sample=None) as ctx:
        yield ctx


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


__all__ = ["DiffusionForwardContext", "get_forward_context", "rows_per_sample", "set_forward_context"]
