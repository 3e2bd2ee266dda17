"""A live server with ``--worker-backend mp``: ``kill -9`` of the stage worker process.

While the stage's worker is down ``GET /health`` answers 503 with the stage ``"restarting"``; the
server itself keeps answering; once the worker is back, ``/health`` is 200 again and the same
greedy request gives the same tokens as before the kill (an adapter loaded at run time through
``/v1/load_lora_adapter`` is served again too: the LoRA journal replayed it).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.entrypoints.server_utils import HTTP, free_port, serve_command, server_env, start_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llm_assets, tmp_path_factory):
    port = free_port()
    flags = [
        "--served-model-name",
        "tiny",
        "--worker-backend",
        "mp",
        "--enable-lora",
        "--max-lora-rank",
        "16",
    ]
    flags += [
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
        "--lora-dirs",
        str(tiny_llm_assets.adapter_a.parent),
    ]
    log = tmp_path_factory.mktemp("serve_worker_death") / "server.log"
    env = server_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    # own_workers: the stage worker is found among the server's descendants (tests/preload.py)
    srv = start_server(
        serve_command(tiny_llm_assets.model_dir, port, *flags), port, log, env, own_workers=True
    )
    yield srv
    srv.stop()


def _tokens(server, **extra) -> list[int]:
    reply = HTTP.post(
        server.url("/v1/completions"), json={**BODY, **extra, "return_token_ids": True}, timeout=120
    )
    assert reply.status_code == 200, reply.text[:500]
    return reply.json()["choices"][0]["token_ids"]


def _stage_worker(server) -> psutil.Process:
    """The server's stage worker: a child of its worker fork server (``vllm_omni/worker_start.py``),
    or a spawned one (multiprocessing ``spawn_main``, not its resource tracker) under
    ``VLLM_OMNI_WORKER_START=spawn``."""
    workers = []
    for child in psutil.Process(server.proc.pid).children():
        cmd = " ".join(child.cmdline())
        if "multiprocessing.forkserver" in cmd:
            workers += child.children()
        elif "spawn_main" in cmd and "resource_tracker" not in cmd:
            workers.append(child)
    assert len(workers) == 1, [w.cmdline() for w in workers]
    return workers[0]


def test_killed_worker_is_reported_then_restarted_with_its_adapters(server, tiny_llm_assets):
    load = {"lora_name": "runtime_a", "lora_path": str(tiny_llm_assets.adapter_a)}
    assert HTTP.post(server.url("/v1/load_lora_adapter"), json=load, timeout=600).status_code == 200
    base, adapted = _tokens(server), _tokens(server, model="runtime_a")
    assert base != adapted  # the adapter changes the answer, so its replay is visible below

    worker = _stage_worker(server)
    os.kill(worker.pid, signal.SIGKILL)
    seen: list[tuple[int, dict]] = []
    # a cap on a restart that never comes (a start takes minutes at a load of 30)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        reply = HTTP.get(server.url("/health"), timeout=600)
        seen.append((reply.status_code, reply.json()))
        if reply.status_code == 200 and any(status == 503 for status, _ in seen):
            break
        time.sleep(0.1)
    assert (503, {"stages": {"0": "restarting"}}) in seen, seen[:5]
    assert seen[-1] == (200, {"stages": {"0": "ready"}}), seen[-5:]
    assert server.alive()

    assert _stage_worker(server).pid != worker.pid
    assert _tokens(server) == base
    assert _tokens(server, model="runtime_a") == adapted
