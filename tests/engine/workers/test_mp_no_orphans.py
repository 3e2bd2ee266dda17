"""No process of an ``mp`` pipeline outlives its driver: SIGTERM, SIGINT or SIGKILL of a script
that runs ``Omni(..., worker_backend="mp")`` with requests in flight. The test counts the
driver's descendants before the signal and waits for every one of them to be gone
(``Omni.shutdown()`` itself is counted by the other modules' fixtures)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from vllm_omni import process_guard

pytestmark = [pytest.mark.engine, pytest.mark.slow]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

DRIVER = textwrap.dedent(
    """
    import sys
    from vllm import SamplingParams
    from vllm_omni import Omni

    if __name__ == "__main__":
        with Omni(model=sys.argv[1], worker_backend="mp", max_model_len=256, dtype="float32") as omni:
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            print("ready", omni._orchestrator.runtimes[0].pid, flush=True)
            while True:
                omni.generate(["hello"] * 4, params, use_tqdm=False)
    """
)


def _alive(procs: list[psutil.Process]) -> list[int]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_no_worker_outlives_the_driver(sig, tiny_llm_assets, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop(process_guard.OWNER_ENV, None)
    driver = subprocess.Popen(
        [sys.executable, str(script), str(tiny_llm_assets.model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = ""
        while not line.startswith("ready"):  # vLLM logs to stdout too
            line = driver.stdout.readline()
            assert line, "the driver exited before its pipeline started"
        worker = int(line.split()[1])
        time.sleep(1.0)  # requests in flight
        procs = psutil.Process(driver.pid).children(recursive=True)
        assert worker in [p.pid for p in procs]
        driver.send_signal(sig)
        driver.wait(timeout=60)
        deadline = time.monotonic() + process_guard.POLL_S + process_guard.GRACE_S + 15
        while _alive(procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(procs) == [], (
            f"{len(_alive(procs))} of {len(procs)} processes outlived the driver ({sig.name})"
        )
    finally:
        if driver.poll() is None:
            driver.kill()
