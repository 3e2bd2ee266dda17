"""Progress of a denoising loop: a tqdm bar on a terminal, INFO log lines otherwise.

A server's stderr is usually a pipe or a file, where a tqdm bar is either invisible (disabled)
or a stream of carriage returns; there the loop's progress goes to the ``vllm_omni`` log
instead, one line when the loop ends and one at most every :data:`LOG_EVERY_S` seconds before.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

#: Seconds between two progress lines of one loop when stderr is not a terminal.
LOG_EVERY_S = 10.0

T = TypeVar("T")


def step_progress(steps: Iterable[T], total: int, desc: str, enabled: bool = True) -> Iterator[T]:
    """Yield ``steps`` while reporting progress (see the module docstring).

    Args:
        steps: the loop's items (e.g. the scheduler's timesteps).
        total: how many there are.
        desc: what the loop is, e.g. ``"denoise"`` (the bar's label and the log lines' prefix).
        enabled: ``False`` reports nothing (``OmniDiffusionConfig.enable_progress_bar``).
    """
    if not enabled:
        yield from steps
        return
    if sys.stderr.isatty():
        yield from tqdm(steps, total=total, desc=desc)
        return
    start = last = time.monotonic()
    for done, item in enumerate(steps, 1):
        yield item  # the caller's step runs before the generator resumes
        now = time.monotonic()
        if done == total or now - last >= LOG_EVERY_S:
            logger.info("%s: step %d/%d, %.1f s", desc, done, total, now - start)
            last = now
