"""``kill -9`` of one stage's ``mp`` worker and the wait for its restart (the Omni worker tests)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from tests.waiting import wait_until
from vllm_omni.errors import StageDeadError

#: a restart is a whole stage start (a vLLM engine for an LLM stage): a guard, not a bound
RESTART_CAP_S = 900.0


def wait_ready(omni, cap_s: float = RESTART_CAP_S) -> None:
    """Wait until every stage of ``omni`` reports ``"ready"``."""
    wait_until(
        lambda: set(omni.stage_health().values()) == {"ready"},
        "every stage to be ready",
        cap_s=cap_s,
        interval_s=0.5,
        describe=omni.stage_health,
    )


def kill_and_wait_restart(omni, stage_id: int, run: Callable[[], object]) -> None:
    """``kill -9`` the worker of ``stage_id`` and wait until the supervisor has replaced it.

    While the stage is down, ``run()`` (a whole request) fails fast with ``StageDeadError`` naming
    the stage. Afterwards the stage runs in a new process, its restart count went up by one, and
    the other stages' workers never stopped.
    """
    runtimes = omni._orchestrator.runtimes
    runtime = runtimes[stage_id]
    others = {i: r.pid for i, r in enumerate(runtimes) if i != stage_id}
    pid, restarts = runtime.pid, runtime.restarts
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: omni.stage_health()[stage_id] != "ready" or runtime.pid != pid,
        f"stage {stage_id} to notice its worker died",
        cap_s=60,
        describe=omni.stage_health,
    )
    if omni.stage_health()[stage_id] == "restarting":  # the pipeline fails fast while the stage is down
        with pytest.raises(StageDeadError, match=rf"Stage {stage_id} \(llm_"):
            run()
    wait_ready(omni)
    assert runtime.pid != pid and runtime.restarts == restarts + 1
    assert {i: r.pid for i, r in enumerate(runtimes) if i != stage_id} == others  # the others never stopped


def kill_ray_actor_and_wait_restart(runtime, call: Callable[[], object], label: str) -> None:
    """``kill -9`` the process of a ``RayStageRuntime``'s actor and wait until it is back.

    Ray reports the death at the next call: ``call()`` (a request to the stage) is repeated until it
    fails with ``StageDeadError`` naming ``label`` (a regex); then the runtime is ``ready`` again after
    exactly one restart. Waits on the supervisor's progress, capped by :data:`RESTART_CAP_S`.
    """

    def reported() -> bool:
        call()  # raises StageDeadError once Ray has seen the death
        return False

    os.kill(runtime.info["pid"], signal.SIGKILL)
    with pytest.raises(StageDeadError, match=label):
        wait_until(reported, "the actor's death to be reported", cap_s=60, interval_s=0.2)
    wait_until(
        lambda: runtime.health() == "ready",
        "the actor to come back",
        cap_s=RESTART_CAP_S,
        interval_s=0.5,
        describe=runtime.health,
    )
    assert runtime.restarts == 1
