"""Shutdown of a real server with requests in flight: bounded drain, no process of ours left.

Each test starts a server, keeps it busy (long requests, more than the drain timeout), then
sends SIGTERM / SIGINT (the server must exit within ``--shutdown-timeout`` plus a slack, long
before the queued work would be done) or SIGKILL (nothing runs in the server any more: its
children must notice and exit). Then every process that descended from the server (collected
just before the signal: vLLM's engine-core process and its worker, our diffusion
tensor-parallel ranks, multiprocessing helpers) must be gone. The servers start their workers
from their own fork server (``own_workers``: as a server run from a shell), so that every
process of theirs descends from them.

Wall-clock bounds scale with the machine's load as measured in the run
(:func:`tests.waiting.load_stretch`, and the time one queued request takes): a loaded 2-core
machine runs everything 10-30 times slower, a hung shutdown never ends. Measured once at a load
of ~90 on 2 cores after SIGKILL of the LLM server: server reaped at 2.7 s, its stage worker gone
at 7.1 s, vLLM's engine core at 9.2 s, vLLM's ``VLLM::Worker`` at 35 s — the worker ran vLLM's own
shutdown (death-pipe EOF, ``gc.collect()`` holding the GIL) and exited; nothing was left, but an
8 s window failed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.entrypoints.server_utils import console_script, free_port, server_env, start_server
from tests.waiting import load_stretch, wait_gone, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.slow]

DRAIN_S = 2  # --shutdown-timeout of the servers under test (an int: vLLM's own flag parses it too)
EXIT_SLACK_S = 13.0  # SIGTERM/SIGINT: exit within DRAIN_S + this on a quiet machine (stage shutdown:
# DRAIN_S more, then exit; ~4 s), times the load stretch measured just before the signal
ORPHANS_CAP_S = 300.0  # cap on the wait for the descendants to go (each level: POLL_S + GRACE_S of
# vllm_omni.process_guard plus its own shutdown; the cap only bounds a wait that never ends)


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _fire(url: str, body: dict, n: int, done: list[float] | None = None) -> list[threading.Thread]:
    """``n`` requests in background threads (their outcome does not matter: the server goes away).

    ``done`` receives the ``time.monotonic()`` of each request that completes with 200. The
    threads share one client (``httpx.Client`` is thread-safe): a client per request built an SSL
    context each, ~10 s of this process's CPU for 256 requests.
    """
    client = httpx.Client(timeout=3600, limits=httpx.Limits(max_connections=n, max_keepalive_connections=0))

    def one() -> None:
        with contextlib.suppress(httpx.HTTPError):
            if client.post(url, json=body).status_code == 200 and done is not None:
                done.append(time.monotonic())

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _assert_in_flight(threads: list[threading.Thread]) -> None:
    assert any(t.is_alive() for t in threads), "the requests finished before the signal: make them longer"


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _stop_and_count(server, sig: int, exit_bound_s: float | None = None) -> None:
    """Send ``sig`` to the busy server; assert the exit bound (not for SIGKILL) and no descendants left.

    ``exit_bound_s``: the SIGTERM/SIGINT exit bound; default ``(DRAIN_S + EXIT_SLACK_S)`` times the
    load stretch measured now.
    """
    children = _descendants(server.proc.pid)
    assert children, "the server should have child processes (engine core / TP ranks)"
    stretch = load_stretch()
    if exit_bound_s is None:
        exit_bound_s = (DRAIN_S + EXIT_SLACK_S) * stretch
    # at a load of ~65 the last descendant went 129 s after SIGKILL (vLLM's worker cleanup, starved)
    orphans_cap = ORPHANS_CAP_S * max(1.0, stretch / 10)
    t0 = time.monotonic()
    server.proc.send_signal(sig)
    # SIGKILL: no code of ours runs (the kernel tears the process down), so only a cap on a wait
    # that never ends
    limit = orphans_cap if sig == signal.SIGKILL else exit_bound_s
    try:
        server.proc.wait(timeout=limit)
    except Exception:
        server.proc.kill()
        server.proc.wait(timeout=600)
        pytest.fail(
            f"server did not exit within {limit:.0f}s of {signal.Signals(sig).name}:\n{server.log_tail()}"
        )
    elapsed = time.monotonic() - t0
    print(f"{signal.Signals(sig).name}: server exited in {elapsed:.1f}s (bound {limit:.0f}s)")
    try:
        wait_gone(children, f"the server's descendants to exit after it did ({elapsed:.1f}s)", orphans_cap)
        print(f"descendants gone {time.monotonic() - t0:.1f}s after the signal")
    finally:
        for p in children:  # never leave them behind, whatever the outcome
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def _busy_llm_server(tiny_llm_assets, tmp_path):
    port = free_port()
    cmd = console_script("vllm-omni") + [
        "serve",
        str(tiny_llm_assets.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "1",
        "--shutdown-timeout",
        str(DRAIN_S),
        "--disable-uvicorn-access-log",
    ]
    server = start_server(
        cmd, port, tmp_path / "server.log", server_env(VLLM_ENABLE_V1_MULTIPROCESSING="1"), own_workers=True
    )
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    # one request at a time (max-num-seqs 1), 0.3-0.5 s each: far more work queued (~80-130 s) than the
    # drain timeout plus the exit bound, so a server that waits for it all fails the bound
    done: list[float] = []
    threads = _fire(server.url("/v1/completions"), body, 256, done)
    # progress, not time: four requests done tell how long one takes here, at this load (the mean of
    # three intervals: on a busy machine two client threads can record their answers at once)
    try:
        wait_until(lambda: len(done) >= 4, "four requests to complete", cap_s=1800, describe=server.log_tail)
    except BaseException:
        server.stop()
        raise
    first = sorted(done)[:4]
    return server, threads, (first[3] - first[0]) / 3


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_llm_server_with_engine_process(sig, tiny_llm_assets, tmp_path):
    server, threads, one_request_s = _busy_llm_server(tiny_llm_assets, tmp_path)
    try:
        _assert_in_flight(threads)
        bound = (DRAIN_S + EXIT_SLACK_S) * load_stretch()
        queued = sum(t.is_alive() for t in threads)
        # the test can tell "drained for DRAIN_S, then stopped" from "waited for the queue"
        assert queued * one_request_s > 3 * bound, (queued, one_request_s, bound)
        _stop_and_count(server, sig, bound)
    finally:
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_diffusion_server_with_tp2_ranks(sig, tiny_z_image_dir, tmp_path):
    port = free_port()
    cmd = console_script("vllm-omni") + [
        "serve",
        str(tiny_z_image_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--tensor-parallel-size",
        "2",
        "--shutdown-timeout",
        str(DRAIN_S),
        "--disable-uvicorn-access-log",
    ]
    server = start_server(cmd, port, tmp_path / "server.log", server_env(), own_workers=True)
    try:
        body = {"prompt": "a cat", "size": "32x32", "num_inference_steps": 1000}
        ranks = _descendants(server.proc.pid)
        cpu0 = _cpu_s(ranks)
        threads = _fire(server.url("/v1/images/generations"), body, 2)
        # progress, not time: the ranks have computed for a while (1000 steps take far longer)
        wait_until(lambda: _cpu_s(ranks) - cpu0 > 2.0, "the TP ranks to work on the requests", cap_s=900,
                   describe=lambda: f"{_cpu_s(ranks) - cpu0:.1f} CPU s; {server.log_tail(10)}")  # fmt: skip
        _assert_in_flight(threads)
        _stop_and_count(server, sig)
    finally:
        server.stop()
