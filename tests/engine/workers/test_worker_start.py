"""How ``mp`` workers start (``vllm_omni/worker_start.py``): forked from the preloaded
fork server, vLLM not imported again, the worker's env in effect; the spawn fallback and opt-out;
the fork server ends with the last pipeline of its process.

The workers here run a probe runtime (a registered-style factory, no model): what is measured is
the start path, not a stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from tests.fork_server import match_the_fork_server
from tests.waiting import wait_until
from vllm_omni import worker_start as start
from vllm_omni.entrypoints.omni_base import build_omni_config

pytestmark = [pytest.mark.engine]


class _Probe:
    """A stage runtime that reports what its worker process sees."""

    def probe(self) -> dict:
        import torch

        return {
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "cwd": os.getcwd(),
            "owner": os.environ.get("OMNI_STAGE_OWNER_PID"),
        }

    def shutdown(self, timeout=None) -> None:
        pass


def probe_factory(stage, config):
    return _Probe()


@pytest.fixture(scope="module")
def stage(tiny_llm_assets):
    return build_omni_config(str(tiny_llm_assets.model_dir), dtype="float32").stages[0]


@pytest.fixture
def server_env(monkeypatch):
    """This process's environment as the fork server saw it when it started, but for variables read
    after import (:func:`tests.fork_server.match_the_fork_server`; the product's rule is checked by
    :func:`test_an_env_read_at_import_or_the_opt_out_spawns`)."""
    match_the_fork_server(monkeypatch)
    return monkeypatch


def _worker(stage, env=None):
    from vllm_omni.engine.workers.client import WorkerStageRuntime

    return WorkerStageRuntime(stage, env=env, factory=probe_factory)


def test_workers_fork_from_one_preloaded_server_with_their_env(stage, server_env):
    first = _worker(stage, {"OMP_NUM_THREADS": "1"})
    try:
        second = _worker(stage, {"OMP_NUM_THREADS": "2"})
        try:
            a, b = first._call("probe"), second._call("probe")
            assert {id(first), id(second)} <= start._holders  # each pipeline holds the fork server
            # both forked from the same fork server, which had imported vLLM before either began
            assert (first.start_method, second.start_method) == ("forkserver", "forkserver")
            assert first.preloaded and second.preloaded
            server = psutil.Process(a["pid"]).ppid()
            assert server == psutil.Process(b["pid"]).ppid() == start._server_pid != os.getpid()
            # the worker's env took effect: libgomp was loaded before it, torch's pool was resized
            assert (a["omp"], a["threads"], first.torch_threads) == ("1", 1, 1)
            assert (b["omp"], b["threads"]) == ("2", 2)
            # the driver's state, not the fork server's
            assert a["cwd"] == os.getcwd() and a["owner"] == str(os.getpid())
            # a crash is reported with its signal (the fork server relays the exit status) and the
            # worker restarts from the same server
            second._handle.proc.kill()
            wait_until(lambda: second.restarts == 1 and second.health() == "ready", "the restart", cap_s=300)
            assert "killed by signal SIGKILL" in second._last_death
            assert second.preloaded and second.pid != b["pid"] and second._call("probe")["threads"] == 2
        finally:
            second.shutdown(30)
    finally:
        first.shutdown(30)
    assert not {id(first), id(second)} & start._holders  # released at shutdown
    assert not psutil.pid_exists(a["pid"]) or psutil.Process(a["pid"]).status() == psutil.STATUS_ZOMBIE


def test_an_env_read_at_import_or_the_opt_out_spawns(stage, server_env):
    monkeypatch = server_env
    # only variables read after import (or applied by the child) may differ from the server's
    assert start._worker_environ({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})[1] == []
    # what ray.init() leaves in a driver's environment does not stop later workers from forking
    for key, value in {
        "PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace",
        "RAY_USAGE_STATS_ENABLED": "0",
    }.items():
        monkeypatch.setenv(key, value)
    assert start._worker_environ({})[1] == []
    flipped = "1" if os.environ.get("HF_HUB_OFFLINE") != "1" else "0"
    assert start._worker_environ({"HF_HUB_OFFLINE": flipped})[1] == ["HF_HUB_OFFLINE"]
    proc, how = start.process_for("s", print, (), {"PYTHONHASHSEED": "7"}, "p")
    assert how == "spawn" and proc._start_method == "spawn"
    monkeypatch.setenv(start.START_ENV, "spawn")
    assert start.process_for("s", print, (), {}, "p")[1] == "spawn"
    monkeypatch.setenv(start.START_ENV, "fork")
    with pytest.raises(ValueError, match="VLLM_OMNI_WORKER_START='fork'"):
        start.process_for("s", print, (), {}, "p")


def test_the_command_line_starts_the_server_unless_no_mp_worker_will_start(monkeypatch):
    from vllm_omni.entrypoints import prestart

    calls = []
    monkeypatch.setattr(start, "start_preloaded", lambda: calls.append(1) or True)
    assert not prestart.start_worker_server(["serve", "m", "--worker-backend", "inline"])
    assert not prestart.start_worker_server(["serve", "m", "--worker-backend=ray"])
    assert calls == []
    assert prestart.start_worker_server(["serve", "m"]) and calls == [1]


_LIFETIME_SCRIPT = r"""
import json, os, sys, time
from vllm_omni import worker_start as start

def children():
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[1]) == os.getpid():
                found.add(int(entry))
    return found

start.PRELOAD = ("vllm_omni.worker_start",)  # a light fork server: its lifetime is the subject
before = children()  # the resource tracker starts with the first fork server; it is not ours to end
first, second = object(), object()  # two pipelines
start.hold(first)
start.hold(second)
for _ in range(2):
    proc, how = start.process_for("probe", time.sleep, (0,), {}, "probe")
    start.start_process(proc, how, {})
    proc.join()
server = start.server_pid()
with_server = children()
start.release(first)
after_first = children()
start.release(second)
after_last = children()
start.hold(first)  # the next pipeline starts a new fork server
proc, how = start.process_for("probe", time.sleep, (0,), {}, "probe")
start.start_process(proc, how, {})
proc.join()
again = start.server_pid()
start.release(first)
print(json.dumps({
    "how": how, "server": server, "again": again, "before": sorted(before), "with_server": sorted(with_server),
    "after_first": sorted(after_first), "after_last": sorted(after_last), "end": sorted(children()),
    "server_gone": not os.path.exists(f"/proc/{server}"), "pid_after": start.server_pid(),
}))
"""


def test_the_fork_server_ends_with_the_last_pipeline_of_its_process():
    """In a process that goes on after its pipelines shut down (``worker_start.release`` by the last
    one), nothing of them stays: the fork server ends and is reaped; the next pipeline starts a new
    one. Run in a fresh interpreter with a fork server that preloads nothing heavy (the rule, not
    the imports, is the subject; this process's own fork server stays for the suite)."""
    env = {**os.environ, start.IDLE_ENV: "0"}  # the default; the suite keeps the fork server longer
    env.pop(start.START_ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", _LIFETIME_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    server, tracker = seen["server"], set(seen["with_server"]) - {seen["server"]}
    assert seen["how"] == "forkserver" and server in seen["with_server"]
    assert server in seen["after_first"]  # the second pipeline still holds it
    assert set(seen["after_last"]) == tracker and seen["server_gone"]  # ended, reaped: no zombie
    assert seen["again"] not in (None, server) and set(seen["end"]) == tracker and seen["pid_after"] is None
    assert len(tracker) <= 1  # multiprocessing's resource tracker (no torch), which stays


def test_a_bad_idle_time_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(start.IDLE_ENV, "soon")
    with pytest.raises(ValueError, match="VLLM_OMNI_WORKER_SERVER_IDLE_S='soon'"):
        start.idle_seconds()
