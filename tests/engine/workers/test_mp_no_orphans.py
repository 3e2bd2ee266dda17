"""No process of an ``mp`` pipeline outlives its driver: SIGTERM, SIGINT or SIGKILL of a script
that runs ``Omni(..., worker_backend="mp")`` with requests in flight. The test counts the
driver's descendants before the signal and waits for every one of them to be gone
(``Omni.shutdown()`` itself is counted by the other modules' fixtures). Also for a worker
started from a fork server shared by several drivers, which outlives this one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests import preload
from tests.waiting import wait_gone, wait_until
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


def _cpu_s(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return t.user + t.system


@pytest.mark.parametrize(
    "sig, shared",
    [(signal.SIGTERM, True), (signal.SIGINT, True), (signal.SIGKILL, True), (signal.SIGKILL, False)],
    ids=["SIGTERM", "SIGINT", "SIGKILL", "SIGKILL-own-fork-server"],
)
def test_no_worker_outlives_the_driver(sig, shared, tiny_llm_assets, tmp_path):
    """``shared``: the driver is forked from a process that shares its worker fork server
    (``tests.fork_server.share_forked_server``, as the suite's zygotes): the worker
    is that fork server's child, which outlives the driver, so the worker must follow the driver
    itself. Otherwise the driver starts its own fork server (as from a shell): every process of
    the pipeline descends from the driver."""
    if shared and os.environ.get("VLLM_OMNI_TEST_FRESH_INTERPRETERS") == "1":
        pytest.skip("no zygote: every command runs as written")
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop(process_guard.OWNER_ENV, None)
    driver = preload.popen(
        [sys.executable, str(script), str(tiny_llm_assets.model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        # a shell's background job (nohup, `&`) starts pytest with SIGINT ignored, and Python keeps an
        # inherited SIG_IGN instead of raising KeyboardInterrupt: the driver must get the default
        sigint_default=True,
        own_workers=not shared,
    )
    try:
        line = ""
        while not line.startswith("ready"):  # vLLM logs to stdout too
            line = driver.stdout.readline()
            assert line, "the driver exited before its pipeline started"
        worker = int(line.split()[1])
        # requests in flight: the worker has computed for a while (progress, not a fixed sleep)
        cpu0 = _cpu_s(worker)
        wait_until(lambda: _cpu_s(worker) - cpu0 > 1.0, "the worker to run the requests", cap_s=900)
        procs = psutil.Process(driver.pid).children(recursive=True)
        if shared:
            server = psutil.Process(worker).parent()
            assert server.pid in preload.shared_fork_servers(), (server.pid, preload.shared_fork_servers())
            procs += [psutil.Process(worker), *psutil.Process(worker).children(recursive=True)]
        assert worker in [p.pid for p in procs]
        driver.send_signal(sig)
        driver.wait(timeout=600)
        wait_gone(procs, f"the driver's {len(procs)} descendants to exit after its {sig.name}")
        if shared:
            assert server.is_running(), "the shared fork server must outlive the driver"
    finally:
        if driver.poll() is None:
            driver.kill()
