"""``vllm_omni.process_guard``: a child of an engine owner exits when the owner is killed outright."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.waiting import wait_gone
from vllm_omni import process_guard

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The owner: marks itself, starts one child with ``method`` and prints its pid. A spawned child
# calls watch_parent (as our diffusion ranks and vLLM's processes, via the plugin, do); a forked
# one gets its watch from the at-fork hook alone.
OWNER = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    from vllm_omni import process_guard

    def child(explicit):
        if explicit:
            process_guard.watch_parent()
        time.sleep(600)

    if __name__ == "__main__":
        method = sys.argv[1]
        process_guard.mark_owner()
        assert not process_guard.watch_parent()  # the owner itself never watches
        proc = mp.get_context(method).Process(target=child, args=(method == "spawn",), daemon=True)
        proc.start()
        print(proc.pid, flush=True)
        time.sleep(600)
    """
)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_child_exits_when_owner_is_killed(method, tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop(process_guard.OWNER_ENV, None)
    owner = subprocess.Popen(
        [sys.executable, str(script), method], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        child = psutil.Process(int(owner.stdout.readline()))
        assert child.is_running()  # its watch may start before or after the kill: both must end it
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=300)
        try:  # progress, not time: the cap only bounds a child that never goes
            wait_gone([child], f"the {method} child {child.pid} to exit after its owner was killed")
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    finally:
        if owner.poll() is None:
            owner.kill()


def test_unmarked_process_does_not_watch(monkeypatch):
    monkeypatch.delenv(process_guard.OWNER_ENV, raising=False)
    assert not process_guard.is_descendant()
    monkeypatch.setenv(process_guard.OWNER_ENV, str(os.getpid()))
    assert not process_guard.is_descendant()  # the owner itself
