"""A local Ray cluster started for a pipeline (``worker_backend="ray"``, no ``RAY_ADDRESS``) leaves
nothing behind: not after ``Omni.shutdown()``, not after its driver is SIGTERM'd or SIGKILL'd.

Each run marks its driver with a unique environment variable, which every Ray process it
starts inherits (GCS, raylet, workers, the stage actor); the test counts the processes that
carry the mark.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("ray")

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MARK = "VLLM_OMNI_RAY_TEST_MARK"


@pytest.fixture(scope="module")
def z_image_dir():
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return ensure_tiny_diffusion_assets(test_assets_root())["z_image"]


def _marked(mark: str) -> list[int]:
    """Pids of live processes whose environment holds ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours
            continue
    return found


def _wait_left(mark: str, expected: list[int], timeout: float = 600.0) -> list[str]:
    """Wait until only the ``expected`` pids carry the mark; the command lines of all that do."""
    deadline = time.monotonic() + timeout
    while (left := _marked(mark)) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return [_cmdline(pid) for pid in left]


def _cmdline(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return f"{pid}: (gone)"


SCRIPT = """
import sys, time
from vllm_omni import Omni
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

if __name__ == "__main__":
    omni = Omni(model={model!r}, worker_backend="ray", dtype="float32", enable_progress_bar=False)
    omni.generate("a robot", OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=1, seed=1))
    print("READY", flush=True)
    sys.stdin.readline()
    omni.shutdown()
    import ray
    assert not ray.is_initialized(), "the local cluster outlived the last pipeline"
    print("SHUT", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("how", ["shutdown", "sigterm", "sigkill"])
def test_nothing_outlives_the_pipeline_or_its_driver(z_image_dir, tmp_path, how):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(SCRIPT.format(model=str(z_image_dir))))
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env[MARK] = mark
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        assert len(_marked(mark)) > 2  # the driver, its cluster and the stage actor
        if how == "shutdown":
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "SHUT"
            assert _wait_left(mark, [proc.pid]) == [_cmdline(proc.pid)]  # only the driver is left
        proc.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
        proc.wait(timeout=600)
        assert _wait_left(mark, []) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _marked(mark):  # a failed run leaves nothing either (these processes are ours)
            os.kill(pid, signal.SIGKILL)
