"""``mkdocs build --strict`` succeeds (broken links, pages missing from the nav, bad config fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _mkdocs() -> list[str] | None:
    local = Path(sys.executable).parent / "mkdocs"
    if local.exists():
        return [str(local)]
    found = shutil.which("mkdocs")
    return [found] if found else None


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    cmd = _mkdocs()
    if cmd is None:
        pytest.skip("mkdocs is not installed")
    proc = subprocess.run(
        [*cmd, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").exists()
