"""Fixtures for the serving tests (helpers live in ``server_utils``)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Timeout (seconds) of an ``httpx`` call that names none: httpx's own default, 5 s, fails a request
#: that merely waits its turn on a loaded machine. A test that needs a short timeout passes its own.
HTTP_TIMEOUT_S = 300.0


def _with_generous_timeout(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        kwargs.setdefault("timeout", HTTP_TIMEOUT_S)
        return fn(*args, **kwargs)

    return call


@pytest.fixture(scope="session", autouse=True)
def generous_http_timeouts():
    """``httpx.get/post/...`` without a ``timeout`` get :data:`HTTP_TIMEOUT_S` in every serving test."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("request", "get", "post", "put", "patch", "delete", "stream"):
            patch.setattr(httpx, name, _with_generous_timeout(getattr(httpx, name)))
        yield


@pytest.fixture(scope="session")
def tiny_z_image_dir() -> Path:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    root = Path(os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO_ROOT / ".cache" / "test_assets")
    return ensure_tiny_diffusion_assets(root)["z_image"]
