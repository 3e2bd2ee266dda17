"""A stage whose restarts are exhausted still shuts down cleanly (``worker_backend="mp"``).

A driver script starts a diffusion stage in an ``mp`` worker on a copy of the tiny Z-Image
checkpoint, adds a run-time adapter, breaks the checkpoint copy (so that every restart fails
while loading it) and the adapter copy, kills the worker with SIGKILL, waits for the stage to
be ``dead``, prints the stage's error and calls ``Omni.shutdown()``. The driver must then exit
on its own, leaving no process behind; before the fix, the workers of restarts that came up
and then "failed" stayed alive reading their pipes and the interpreter waited on them at exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests import preload
from vllm_omni import process_guard

pytestmark = [pytest.mark.engine, pytest.mark.slow]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

DRIVER = textwrap.dedent(
    """
    import os, shutil, signal, sys, time
    from vllm_omni import Omni
    from vllm_omni.errors import StageDeadError
    from vllm_omni.lora.request import LoRARequest

    if __name__ == "__main__":
        model, adapter = sys.argv[1], sys.argv[2]
        omni = Omni(model=model, dtype="float32", enable_progress_bar=False, worker_backend="mp",
                    max_loras=2, stage_0_max_restarts=2, stage_0_restart_backoff_s=0.1)
        runtime = omni._orchestrator.runtimes[0]
        omni.add_lora(LoRARequest("a", 1, adapter))
        shutil.rmtree(os.path.join(model, "transformer"))
        shutil.rmtree(adapter)
        print("killing", runtime.pid, flush=True)
        os.kill(runtime.pid, signal.SIGKILL)
        deadline = time.monotonic() + 900
        while omni.stage_health()[0] != "dead" and time.monotonic() < deadline:
            time.sleep(0.5)
        print("health", omni.stage_health()[0], runtime.restart_attempts, flush=True)
        try:
            omni.generate("a cat")
        except StageDeadError as exc:
            print("error", str(exc).replace(chr(10), " "), flush=True)
        omni.shutdown()
        print("shut down", flush=True)
    """
)


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def test_exhausted_restarts_shut_down_and_exit(tmp_path):
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets
    from tools.make_tiny_diffusion_lora import ensure_tiny_z_image_loras

    z_image = ensure_tiny_diffusion_assets(test_assets_root())["z_image"]
    model = tmp_path / "z_image"
    shutil.copytree(z_image, model)
    adapter = tmp_path / "adapter"
    shutil.copytree(ensure_tiny_z_image_loras(z_image, test_assets_root())["attn"], adapter)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop(process_guard.OWNER_ENV, None)
    driver = preload.popen(
        [sys.executable, str(script), str(model), str(adapter)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,  # built above and, until now, never passed
    )
    seen: list[psutil.Process] = []
    lines: list[str] = []
    try:
        # wait on progress: the driver's own lines, its children as they come and go, its exit
        deadline = time.monotonic() + 1500
        while driver.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.NoSuchProcess):
                seen += [c for c in psutil.Process(driver.pid).children(recursive=True) if c not in seen]
            time.sleep(0.5)
        out = driver.stdout.read() if driver.poll() is not None else ""
        lines = out.splitlines()
        assert driver.returncode == 0, (
            f"the driver did not exit (rc {driver.returncode}); alive: {_alive(seen)}\n" + out[-4000:]
        )
    finally:
        if driver.poll() is None:
            leftover = _alive(seen)
            for p in [psutil.Process(driver.pid), *seen]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            driver.wait(30)
            pytest.fail(
                f"the driver hung after shutdown; alive: {leftover}; output: {driver.stdout.read()[-4000:]}"
            )
    health = next(line for line in lines if line.startswith("health"))
    assert health.split()[1:] == ["dead", "2"]
    error = next(line for line in lines if line.startswith("error"))
    # the stage, the death, the attempt and the cause
    assert "Stage 0 (diffusion) is dead" in error and "killed by signal SIGKILL" in error
    assert "restart attempt 2 of 2 failed" in error and "transformer" in error
    assert "shut down" in lines
    # nothing the driver started is left
    deadline = time.monotonic() + 60
    while _alive(seen) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(seen) == []
