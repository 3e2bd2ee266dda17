"""For tests whose subject is a worker forked from the worker fork server
(:mod:`vllm_omni.engine.workers.start`): this process's environment as the fork server saw it."""

from __future__ import annotations

import os

import pytest

from vllm_omni.engine.workers import start


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
