"""Adapter and no-adapter requests in one batch (issue 13, item 14).

vLLM's torch LoRA ops (the CPU punica path) select the stacked weights with the per-row LoRA
index, and "no adapter" (-1) wraps to the last slot. ``vllm_omni.platform.patch_torch_lora_ops``
makes those rows contribute nothing. The raw-vLLM test runs in its own process (unpatched ops)
and fails, saying so, once upstream is right.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams

from tests.engine.engine_process_probe import MIXED_NAMES, N_TOKENS, mixed_prompt, probe_result, run_probe
from tests.llm_reference import hf_greedy
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest, RequestAdapters
from vllm_omni.platform import PATCHED_LORA_OPS, patch_torch_lora_ops, torch_lora_ops_patched

REPO_ROOT = Path(__file__).resolve().parents[2]


def references(assets) -> list[list[int]]:
    """transformers+peft greedy tokens (float32) for each request of the mixed batch."""
    adapters = {"a": assets.adapter_a, "b": assets.adapter_b}
    return [
        hf_greedy(assets.model_dir, mixed_prompt(i), N_TOKENS, adapters.get(name))
        for i, name in enumerate(MIXED_NAMES)
    ]


# ------------------------------------------------------------------ the ops themselves
def test_patched_ops_give_rows_without_adapter_exactly_no_contribution():
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    patch_torch_lora_ops()
    patch_torch_lora_ops()  # idempotent: wrapped once
    assert torch_lora_ops_patched()
    for name in PATCHED_LORA_OPS:
        op = getattr(lora_ops, name)
        assert getattr(torch_ops, name) is op and getattr(punica_cpu, name) is op
        assert not hasattr(op.vllm_omni_original, "vllm_omni_original")

    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([0, -1, 1, -1])
    x = torch.randn(4, 8, generator=g)
    lora_a = torch.randn(2, 1, 3, 8, generator=g)  # [slots, 1, r, in]
    lora_b = torch.randn(2, 1, 5, 3, generator=g)  # [slots, 1, out, r]
    has = idx >= 0

    buf = torch.full((4, 3), 7.0)
    lora_ops.bgmv_shrink(x, lora_a, buf, idx, 0.5)
    for i in range(4):
        want = 0.5 * lora_a[idx[i], 0] @ x[i] if has[i] else torch.zeros(3)
        torch.testing.assert_close(buf[i], want, rtol=0, atol=1e-6)

    y0 = torch.randn(4, 5, generator=g)
    y = y0.clone()
    lora_ops.bgmv_expand(buf, lora_b, y, idx, add_inputs=True)
    y_slice = torch.cat([y0, y0], dim=1)
    lora_ops.bgmv_expand_slice(buf, lora_b, y_slice, idx, 5, 5, add_inputs=True)
    for i in range(4):
        if has[i]:
            torch.testing.assert_close(y[i], y0[i] + lora_b[idx[i], 0] @ buf[i], rtol=0, atol=1e-5)
        else:
            assert torch.equal(y[i], y0[i]) and torch.equal(y_slice[i, 5:], y0[i])
        assert torch.equal(y_slice[i, 5:], y[i]) and torch.equal(y_slice[i, :5], y0[i])

    # one decode row without adapter (the op's single-row broadcast path): nothing added
    y1 = y0[:1].clone()
    lora_ops.bgmv_expand(buf[1:2], lora_b, y1, idx[1:2], add_inputs=True)
    assert torch.equal(y1, y0[:1])


# ------------------------------------------------------------------ raw vLLM vs the patch
@pytest.mark.engine
@pytest.mark.slow
def test_raw_vllm_gives_no_adapter_rows_an_adapter_and_the_patch_fixes_it(tiny_llm_assets):
    """Fails with "upstream fixed" once vLLM's own ops honour -1: then remove the patch."""
    # VLLM_PLUGINS lists no plugin of ours: an installed vllm_omni must not patch this process
    result = probe_result(run_probe("raw-mixed", tiny_llm_assets.model_dir.parent, VLLM_PLUGINS="none"))
    assert not result["patched_at_start"], "the probe's raw vLLM ran with the patch already applied"
    refs = references(tiny_llm_assets)
    raw, patched = result["outputs"]["unpatched"], result["outputs"]["patched"]
    with_adapter = [i for i, n in enumerate(MIXED_NAMES) if n is not None]
    without = [i for i, n in enumerate(MIXED_NAMES) if n is None]
    assert all(raw[i] == refs[i] for i in with_adapter), "raw vLLM is wrong on adapter rows too"
    if all(raw[i] == refs[i] for i in without):
        pytest.fail(
            "upstream fixed: raw vLLM now gives no-adapter rows of a mixed LoRA batch no adapter; "
            "remove patch_torch_lora_ops (vllm_omni/platform.py) and this test"
        )
    assert patched == refs, "with the patch every request equals transformers+peft"


@pytest.mark.engine
def test_omni_mixed_batch_equals_transformers_peft_per_request(tiny_llm_assets):
    """One engine batch holding adapter and no-adapter requests (no separation), float32."""
    from vllm_omni import Omni

    with Omni(
        str(tiny_llm_assets.model_dir),
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        max_model_len=256,
        dtype="float32",
        max_num_seqs=8,
    ) as omni:
        assert torch_lora_ops_patched()
        runtime = omni._orchestrator.runtimes[0]
        adapters = {
            "a": LoRARequest("a", 1, str(tiny_llm_assets.adapter_a)),
            "b": LoRARequest("b", 2, str(tiny_llm_assets.adapter_b)),
        }
        step, batch_kinds = runtime._engine.step, []

        def recording_step():  # on the driver thread: which kinds share the engine at each step
            batch_kinds.append({item.lora_request is not None for item in runtime._running.values()})
            return step()

        runtime._engine.step = recording_step
        params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
        with runtime.hold():  # all start in one step
            futures = [
                runtime.submit(StageRequest(mixed_prompt(i), params, RequestAdapters.of(adapters.get(n))))
                for i, n in enumerate(MIXED_NAMES)
            ]
        outs = [list(f.result(timeout=300).outputs[0].token_ids) for f in futures]
        del runtime._engine.step
    assert {True, False} in batch_kinds, "adapter and no-adapter requests never shared a step"
    assert outs == references(tiny_llm_assets)


# ------------------------------------------------------------------ the vLLM plugin
def _declared_plugin() -> str:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"]["vllm.general_plugins"]["vllm_omni"]


def test_pyproject_registers_the_vllm_general_plugin():
    import importlib

    module, _, func = _declared_plugin().partition(":")
    assert getattr(importlib.import_module(module), func).__name__ == "prepare_engine_process"


@pytest.mark.engine
@pytest.mark.slow
def test_vllm_loads_the_plugin_in_a_spawned_engine_core(tiny_llm_assets, tmp_path):
    """Raw ``vllm.LLM`` with its engine core in a spawned process: the plugin (declared as in
    pyproject.toml, on the path through a dist-info folder) patches that process too."""
    dist = tmp_path / "vllm_omni_plugin_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-omni-plugin-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\nvllm_omni = {_declared_plugin()}\n")
    proc = run_probe(
        "raw-mixed",
        tiny_llm_assets.model_dir.parent,
        PYTHONPATH=str(tmp_path),
        VLLM_PLUGINS="vllm_omni",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_WORKER_MULTIPROC_METHOD="spawn",
    )
    result = probe_result(proc)
    # "unpatched" here is only the label of the first run: the plugin patched the engine core
    assert result["outputs"]["unpatched"] == references(tiny_llm_assets)
