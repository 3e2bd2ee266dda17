"""The stage keys ``devices`` and ``replicas``: parsing and the checks that need no engine.

``devices`` names where a stage's workers run: ``"cpu"``, ``"cuda:0"``, a comma-separated
string (``"cuda:1,cuda:2"``) or a list of such names. ``replicas`` is how many copies of the
stage serve requests (an integer >= 1). The CUDA devices are split in order into one group
of ``parallel size`` devices per replica, so their number must be ``parallel size x replicas``
(``"cpu"`` alone serves any parallel size and any number of replicas). The process backends
turn each group into the worker's ``CUDA_VISIBLE_DEVICES`` (``vllm_omni.engine.placement``).

Messages here name the key and the problem; the stage config prefixes the input and the stage.
"""

from __future__ import annotations

import re
from typing import Any

from vllm_omni.errors import ConfigError

_CUDA = re.compile(r"^cuda:(\d+)$")
_EXAMPLES = "'cpu', 'cuda:0', 'cuda:1,cuda:2' or a list such as ['cuda:0', 'cuda:1']"


def parse_devices(value: Any) -> list[str] | None:
    """``devices`` as a list of normalised names (``None`` when unset).

    Args:
        value: ``None``, a string (comma-separated names) or a list/tuple of name strings.

    Returns:
        e.g. ``["cuda:1", "cuda:2"]`` or ``["cpu"]``.

    Raises:
        ConfigError (``options=("devices",)``): not a string or list of strings, an empty
            entry, a name other than ``cpu`` / ``cuda:<index>``, a device listed twice, or
            ``cpu`` mixed with CUDA devices.
    """
    if value is None:
        return None
    if isinstance(value, str):
        names = value.split(",")
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        names = list(value)
    else:
        raise ConfigError(
            f"devices must be {_EXAMPLES}; got {type(value).__name__}: {value!r}", options=("devices",)
        )
    names = [n.strip().lower() for n in names]
    if not names or "" in names:
        raise ConfigError(
            f"devices has an empty entry: {value!r}; expected {_EXAMPLES}", options=("devices",)
        )
    bad = [n for n in names if n != "cpu" and not _CUDA.match(n)]
    if bad:
        hint = " (name the index: 'cuda:0')" if "cuda" in bad else ""
        raise ConfigError(
            f"devices: unknown device name(s) {bad}{hint}; expected {_EXAMPLES}", options=("devices",)
        )
    names = [n if n == "cpu" else f"cuda:{int(n.partition(':')[2])}" for n in names]  # cuda:01 -> cuda:1
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"devices lists {twice} more than once: {value!r}", options=("devices",))
    if "cpu" in names and len(names) > 1:
        raise ConfigError(
            f"devices mixes 'cpu' with CUDA devices: {value!r}; a stage runs on the CPU or on CUDA devices",
            options=("devices",),
        )
    return names


def check_replicas(value: Any) -> int:
    """``replicas`` checked: an integer >= 1 (``True`` is not an integer here).

    Raises:
        ConfigError (``options=("replicas",)``): anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"replicas must be an integer >= 1, got {type(value).__name__}: {value!r}", options=("replicas",)
        )
    return value


def check_device_count(devices: list[str] | None, parallel: int, parallel_name: str, replicas: int) -> None:
    """Check that CUDA ``devices`` split into ``replicas`` groups of ``parallel`` devices.

    Args:
        devices: from :func:`parse_devices`; ``None`` or ``["cpu"]`` always pass.
        parallel: devices one replica needs (its parallel size).
        parallel_name: how the message names ``parallel`` (e.g. ``"tensor_parallel_size (2)"``).
        replicas: from :func:`check_replicas`.

    Raises:
        ConfigError (``options=("devices", "replicas")``): the count differs; the message states the rule.
    """
    if devices is None or devices == ["cpu"]:
        return
    need = parallel * replicas
    if len(devices) != need:
        raise ConfigError(
            f"devices lists {len(devices)} device(s) {devices}, but the stage needs {parallel_name} x "
            f"replicas ({replicas}) = {need}: the devices are split in order into one group of "
            f"{parallel} per replica",
            options=("devices", "replicas"),
        )
