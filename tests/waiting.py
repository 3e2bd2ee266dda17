"""Wait on progress, not on time: the one polling helper of the test suite.

A test that sleeps a fixed time and then asserts, or that gives a process a few seconds to do
something, fails on a loaded machine (CI runs under whatever load is there: a 2-core machine at a
load of 30 runs everything ~15x slower). Instead, wait until the thing you need has happened
(a process state, a log line, a health endpoint, a counter), with a cap that only guards against
a wait that never ends, and say what was seen when the cap is reached.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import psutil

T = TypeVar("T")

#: Multiplies every cap given to :func:`wait_until` (``VLLM_OMNI_TEST_WAIT_SCALE``, default 1):
#: raise it on an unusually slow machine rather than editing tests.
WAIT_SCALE = float(os.environ.get("VLLM_OMNI_TEST_WAIT_SCALE", "1"))


class WaitTimeout(AssertionError):
    """The awaited condition did not hold within the cap (an ``AssertionError``: a test failure)."""


def wait_until(
    predicate: Callable[[], T],
    what: str,
    *,
    cap_s: float = 300.0,
    interval_s: float = 0.1,
    describe: Callable[[], object] | None = None,
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    Args:
        predicate: the check (no arguments). An exception it raises propagates at once: raise one
            when waiting longer cannot help (the process under test exited, say).
        what: what is awaited, for the failure message ("the server answers /health").
        cap_s: seconds after which to give up (times :data:`WAIT_SCALE`); a guard against a wait
            that never ends, not a performance bound: make it generous.
        interval_s: seconds between two checks.
        describe: called once on failure; its result (the state seen: a log tail, the processes
            still alive) goes into the message.

    Raises:
        WaitTimeout: ``predicate`` was still falsy after the cap.
    """
    cap = cap_s * WAIT_SCALE
    start = time.monotonic()
    checks = 0
    while True:
        value = predicate()
        checks += 1
        if value:
            return value
        waited = time.monotonic() - start
        if waited >= cap:
            seen = describe() if describe is not None else value
            raise WaitTimeout(f"waited {waited:.1f}s ({checks} checks) for {what}; last seen: {seen}")
        time.sleep(interval_s)


def alive(procs: list[psutil.Process]) -> list[str]:
    """``"pid name status cmdline"`` of each process in ``procs`` that still runs (zombies do not count)."""
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {p.name()} {p.status()} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def wait_gone(procs: list[psutil.Process], what: str, cap_s: float = 600.0) -> None:
    """Wait until none of ``procs`` runs; on the cap, fail listing those that still do."""
    wait_until(lambda: not alive(procs), what, cap_s=cap_s, interval_s=0.2, describe=lambda: alive(procs))


def load_stretch(cpu_s: float = 0.3) -> float:
    """How many times longer than its CPU time a CPU-bound piece of work takes here, now (>= 1).

    Runs a busy loop for ``cpu_s`` seconds of this thread's CPU time and divides the wall time
    it took by that: ~1 on a quiet machine, ~15 on 2 cores at a load of 30. A bound that is a
    product property measured in wall time (a drain timeout plus slack) is multiplied by it.
    """
    wall0, cpu0 = time.monotonic(), time.thread_time()
    while time.thread_time() - cpu0 < cpu_s:
        sum(range(1000))
    return max(1.0, (time.monotonic() - wall0) / (time.thread_time() - cpu0))
