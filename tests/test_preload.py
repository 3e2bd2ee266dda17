"""``tests/preload.py``: a command forked from a preloaded interpreter behaves as the fresh one.

The reference is the same command run by ``subprocess`` in a fresh interpreter: a probe script
reports what a script can observe (argv, cwd, ``__file__``, ``sys.path[0]``, the environment as
vLLM reads it, OpenMP's thread count, a ``multiprocessing`` spawn, stdio, the exit status) and
the forked run must report the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests import preload

PROBE = textwrap.dedent(
    """
    import json, multiprocessing, os, sys

    def square(q, x):
        q.put(x * x)

    if __name__ == "__main__":
        import torch
        import vllm.envs as envs

        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=square, args=(q, 7))
        p.start()
        spawned = q.get()
        p.join()
        print(json.dumps({
            "argv": sys.argv, "cwd": os.getcwd(), "file": __file__, "path0": sys.path[0],
            "kv": envs.VLLM_CPU_KVCACHE_SPACE, "lora_updating": envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING,
            "omp_threads": torch.get_num_threads(), "spawned": spawned, "sum": torch.arange(10.0).sum().item(),
        }))
        print("to stderr", file=sys.stderr)
        sys.exit(int(sys.argv[1]))
    """
)


BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5:\n    pass\n"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preload")
    (folder / "probe.py").write_text(PROBE)
    return folder


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


def _report(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "extra",
    [
        {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},  # read after import
        {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "2"},  # OMP_NUM_THREADS: read when libgomp loads
    ],
    ids=["read-later", "own-zygote"],
)
def test_forked_equals_fresh(probe, extra):
    cmd = [sys.executable, "probe.py", "5"]
    fresh = subprocess.run(cmd, cwd=probe, env=_env(**extra), capture_output=True, text=True, timeout=900)
    forked = preload.run(cmd, cwd=probe, env=_env(**extra), capture_output=True, text=True, timeout=900)
    assert fresh.returncode == forked.returncode == 5, (fresh.stderr[-2000:], forked.stderr[-2000:])
    assert _report(forked) == _report(fresh)
    assert _report(fresh)["spawned"] == 49 and _report(fresh)["kv"] == int(extra["VLLM_CPU_KVCACHE_SPACE"])
    assert forked.stderr.strip().splitlines()[-1] == "to stderr"
    assert "RuntimeWarning" not in forked.stderr
    key = preload._key(_env(**extra))
    assert key in preload._zygotes, "the command was not forked"


def test_module_run_and_signals(probe):
    """``python -m`` of a preloaded module runs a fresh copy (no runpy warning); SIGTERM is reported
    as ``Popen`` reports it."""
    out = preload.run([sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "--help"], env=_env(),
                      capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0 and "serve" in out.stdout, out.stderr[-2000:]
    assert out.stderr == "", out.stderr[-2000:]
    (probe / "sleeper.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    log = probe / "sleeper.log"
    with open(log, "w") as f:
        proc = preload.popen([sys.executable, "sleeper.py"], cwd=probe, env=_env(), stdout=f,
                             stderr=subprocess.STDOUT)  # fmt: skip
    assert isinstance(proc, preload.ForkedProcess)
    from tests.waiting import wait_until

    wait_until(lambda: log.read_text() == "up\n", "the sleeper to print", cap_s=600, interval_s=0.1)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.terminate()
    assert proc.wait() == -signal.SIGTERM


def test_what_is_not_forked(probe):
    """Interpreter options and ``-c`` run as written, by ``subprocess``."""
    for cmd in (
        [sys.executable, "-c", "pass"],
        [sys.executable, "-X", "importtime", "probe.py", "0"],
        ["true"],
    ):
        assert preload._plan(cmd) is None, cmd
    proc = preload.popen([sys.executable, "-c", "import sys; sys.exit(3)"], env=_env())
    assert isinstance(proc, subprocess.Popen) and proc.wait() == 3


def test_cap_closes_idle_zygotes(monkeypatch, probe):
    """Past :data:`MAX_ZYGOTES` environments, an idle zygote is closed for the new one."""
    monkeypatch.setattr(preload, "MAX_ZYGOTES", 1)
    monkeypatch.setattr(preload, "_zygotes", {})
    monkeypatch.setattr(preload, "PRELOAD", ("json",))  # a cheap zygote
    first = preload.run([sys.executable, "-m", "json.tool", "--help"], env=_env(OMNI_PRELOAD_T="a"),
                        capture_output=True, text=True, timeout=900)  # fmt: skip
    (z1,) = preload._zygotes.values()
    second = preload.run([sys.executable, "-m", "json.tool", "--help"], env=_env(OMNI_PRELOAD_T="b"),
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    (probe / "burn.py").write_text(BURN)
    burn = preload.run([sys.executable, "burn.py"], cwd=probe, env=_env(OMNI_PRELOAD_T="b"), timeout=900)
    (z2,) = preload._zygotes.values()
    assert first.returncode == second.returncode == burn.returncode == 0 and "usage" in second.stdout
    assert z1 is not z2 and z1.proc.poll() == 0, "the idle zygote was not closed"
    before = os.times().children_user + os.times().children_system + preload.reaped_cpu_s()
    z2.close()  # its child's CPU moves from reaped_cpu_s() to os.times(): counted once
    after = os.times().children_user + os.times().children_system + preload.reaped_cpu_s()
    assert z2._children_cpu_s >= 1.5
    assert 0 <= after - before < 1.0  # the zygote's own start only (Python and json), not burn.py again


def test_reaped_cpu_is_counted(probe):
    """The suite's cost record counts a forked process's CPU (``tests/conftest.py``)."""
    (probe / "burn.py").write_text(BURN)
    before = preload.reaped_cpu_s()
    out = preload.run([sys.executable, "burn.py"], cwd=probe, env=_env(), capture_output=True, timeout=900)
    assert out.returncode == 0 and preload._key(_env()) in preload._zygotes
    assert preload.reaped_cpu_s() - before >= 1.5


@pytest.mark.parametrize(
    "body",
    ["import sys\nsys.exit('refused')\n", "def f():\n    raise ValueError('bad')\nf()\n",
     "raise KeyboardInterrupt\n", "import sys\nsys.exit(0)\n", "print('end')\n"],
    ids=["exit-message", "exception", "keyboard-interrupt", "exit-0", "falls-off"],
)  # fmt: skip
def test_endings_equal_fresh(probe, body):
    """However a script ends, the status and stderr are those of a fresh interpreter."""
    (probe / "ending.py").write_text(body)
    cmd = [sys.executable, "ending.py"]
    fresh = subprocess.run(cmd, cwd=probe, env=_env(), capture_output=True, text=True, timeout=900)
    forked = preload.run(cmd, cwd=probe, env=_env(), capture_output=True, text=True, timeout=900)
    assert preload._plan(cmd) is not None and preload._key(_env()) in preload._zygotes
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
