"""Freed CPU memory stays in the heap (``vllm_omni.platform.keep_freed_cpu_memory``).

glibc hands a freed block above its mmap threshold (at most 32 MiB while dynamic) back to the
kernel, so the next allocation of that size faults every page in again; the diffusion worker's
steps paid ~10,000 minor faults each on the benchmark model. The probe runs in its own process
(forked from the suite's preloaded interpreter): ``mallopt`` changes that process for good.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from tests import preload
from vllm_omni import platform

PROBE = textwrap.dedent(
    """
    import resource, sys
    import torch
    from vllm_omni.platform import keep_freed_cpu_memory

    if sys.argv[1] == "keep":
        assert keep_freed_cpu_memory(), "mallopt was not applied"
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):  # the heap grows to its working size over the first few blocks
        torch.ones(12 << 20)  # 48 MiB of float32, freed at once: above glibc's largest dynamic threshold
    before = faults()
    for _ in range(10):
        torch.ones(12 << 20)
    print("faults per 48 MiB block:", (faults() - before) / 10)
    """
)


def _faults_per_block(tmp_path, mode: str) -> float:
    script = tmp_path / "heap_probe.py"
    script.write_text(PROBE)
    out = preload.run([sys.executable, str(script), mode], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return float(out.stdout.strip().rsplit(" ", 1)[-1])


def test_freed_blocks_are_reused_without_page_faults(tmp_path):
    default = _faults_per_block(tmp_path, "default")
    kept = _faults_per_block(tmp_path, "keep")
    # 48 MiB is 12,288 pages of 4 KiB (24 of 2 MiB where transparent huge pages are "always"): glibc's
    # default faults (nearly) all of them in again per block; a kept heap faults none
    assert default >= 20, f"expected the default heap to fault the block in again, saw {default}"
    assert kept <= default / 10, (
        f"freed blocks still fault in after keep_freed_cpu_memory: {kept} vs {default}"
    )


@pytest.mark.parametrize(
    "name, value",
    [("MALLOC_TRIM_THRESHOLD_", "1000000"), ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1"),
     ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")],
)  # fmt: skip
def test_a_users_allocator_choice_is_left_alone(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert platform.keep_freed_cpu_memory.__wrapped__() is False
