"""The stage keys ``max_restarts`` and ``restart_backoff_s``: a stage worker's restart policy.

They apply to stages whose runtime runs in a worker (``worker_backend`` ``"mp"`` or ``"ray"``;
each replica has its own budget) and are read by
:class:`~vllm_omni.engine.workers.supervisor.SupervisedStageRuntime`:

- ``max_restarts``: restart **attempts** the stage's worker may get over the runtime's life
  (every start of a replacement worker counts, whether it comes up or not); ``0``: never
  restarted. Default :data:`DEFAULT_MAX_RESTARTS`.
- ``restart_backoff_s``: seconds before the first attempt after a death, doubled for every
  attempt that failed in a row (at most :data:`BACKOFF_MAX_S`). Default
  :data:`DEFAULT_RESTART_BACKOFF_S`.

Messages here name the key and the problem; the stage config prefixes the input and the stage.
"""

from __future__ import annotations

import math
from typing import Any

from vllm_omni.errors import ConfigError

#: Default of ``max_restarts``.
DEFAULT_MAX_RESTARTS = 5
#: Default of ``restart_backoff_s`` (seconds).
DEFAULT_RESTART_BACKOFF_S = 0.5
#: Longest wait between two restart attempts (seconds).
BACKOFF_MAX_S = 30.0


def check_max_restarts(value: Any) -> int:
    """``max_restarts`` checked: an integer >= 0.

    Raises:
        ConfigError (``options=("max_restarts",)``): anything else (``True`` included).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"max_restarts must be an integer >= 0 (restart attempts over the stage's life), "
            f"got {type(value).__name__}: {value!r}",
            options=("max_restarts",),
        )
    return value


def check_restart_backoff_s(value: Any) -> float:
    """``restart_backoff_s`` checked: a finite number of seconds >= 0.

    Raises:
        ConfigError (``options=("restart_backoff_s",)``): anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"restart_backoff_s must be a number of seconds >= 0, got {type(value).__name__}: {value!r}",
            options=("restart_backoff_s",),
        )
    return float(value)
