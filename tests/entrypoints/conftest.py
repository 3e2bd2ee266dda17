"""Fixtures for the serving tests (helpers live in ``server_utils``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_z_image_dir() -> Path:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    root = Path(os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO_ROOT / ".cache" / "test_assets")
    return ensure_tiny_diffusion_assets(root)["z_image"]
