"""The worker fork server (:mod:`vllm_omni.worker_start`) as the test suite uses it.

- :func:`share_forked_server` / :func:`use_own_fork_server`: the suite's zygotes (``tests/preload.py``)
  fork the fork server from themselves and share it with the commands they fork;
- :func:`match_the_fork_server`: for tests whose subject is a worker forked from the fork server,
  this process's environment as the fork server saw it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from vllm_omni import worker_start as start

if TYPE_CHECKING:  # the zygotes import this module: no pytest there
    import pytest


def match_the_fork_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start this process's worker fork server (unless it runs) and set, through ``monkeypatch``,
    this process's environment to the one the fork server started with, but for variables read
    after import. Earlier tests of the same pytest worker may have left variables set after the
    fork server started: a test's precondition, not the product's rule (a worker whose environment
    differs is spawned), which ``tests/engine/workers/test_worker_start.py`` checks."""
    monkeypatch.delenv(start.START_ENV, raising=False)
    start.start_preloaded()
    base = start._server_env or {}
    for key in set(base) | set(os.environ):
        if key in start.READ_AFTER_IMPORT or base.get(key) == os.environ.get(key):
            continue
        if key in base:
            monkeypatch.setenv(key, base[key])
        else:
            monkeypatch.delenv(key)


def share_forked_server(environ_before_imports: Mapping[str, str]) -> int | None:
    """Start this process's worker fork server as a fork of this process, shared with the
    processes forked from this one later (``os.fork`` without ``exec``).

    For a launcher that forks drivers from a preloaded interpreter (the test suite's zygotes,
    ``tests/preload.py``): the fork server has this process's modules, so it costs no import
    (a spawned one imports torch and vLLM again, ~8 s of CPU), and a forked driver starts its
    workers from it (:func:`vllm_omni.worker_start.start_preloaded`) instead of starting a fork server of its own. Each
    such worker follows its own driver (:func:`vllm_omni.process_guard.follow`), not the fork
    server, which lives as long as this process or a fork of it does. Call it while this
    process runs one thread and has run no torch op (the workers inherit its state, as the fork
    server's own). ``environ_before_imports``: this process's environment before its imports,
    against which a worker's environment is compared (as for a spawned fork server, whose
    imports start from that environment).

    Returns:
        The fork server's pid; ``None`` when workers spawn (:data:`START_ENV`).

    Raises:
        ValueError: :data:`START_ENV` is set to something else than :data:`START_METHODS`.
        RuntimeError: this process already has a fork server.
    """
    if start.start_method() != "forkserver":
        return None
    import importlib
    import socket
    from multiprocessing import connection, forkserver, resource_tracker

    for name in start.PRELOAD:  # imported here once: the fork server and every fork of this process have them
        importlib.import_module(name)
    with start.START_LOCK:
        server = forkserver._forkserver
        if server._forkserver_pid is not None:
            raise RuntimeError(f"this process already has a worker fork server ({server._forkserver_pid})")
        resource_tracker.ensure_running()  # before the fork, as ``ensure_running`` does
        address = connection.arbitrary_address("AF_UNIX")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _serve_forked(listener.fileno(), alive_r)  # never returns
        listener.close()
        os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd = address, alive_w
        server._forkserver_pid = pid
        server._preload_modules = list(start.PRELOAD)
        start._server_env, start._server_pid, start._started_by = (
            dict(environ_before_imports),
            pid,
            os.getpid(),
        )
        start._forked, start._shared = False, True
    return pid


def _serve_forked(listener_fd: int, alive_r: int) -> None:
    """The forked fork server: multiprocessing's own fork-server loop on ``listener_fd``, which
    ends when every holder of the "alive" pipe's write end is gone; only stdio, the listener and
    ``alive_r`` stay open (a descriptor of the launcher kept here would outlive the launcher)."""
    try:
        keep = {0, 1, 2, listener_fd, alive_r}
        with contextlib.suppress(OSError):
            for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
                if fd not in keep:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        from multiprocessing import forkserver

        forkserver.main(listener_fd, alive_r, list(start.PRELOAD), sys_path=list(sys.path))
    finally:
        os._exit(0)


def use_own_fork_server() -> None:
    """In a process forked from one that shares its fork server (:func:`share_forked_server`): start
    a fork server of its own at the next worker start, so that its workers are its descendants."""
    start._shared = False
