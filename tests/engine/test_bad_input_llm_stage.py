"""Hostile / careless input on an LLM stage: a clear error naming the culprit, nothing lost,
never a hang and never a silent no-op (an adapter served with other weights than its own)."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from safetensors.torch import load_file, save_file
from vllm import SamplingParams

from tests.llm_reference import hf_greedy
from tests.waiting import wait_until
from vllm_omni.errors import InvalidAdapterError, StageEngineError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest

pytestmark = pytest.mark.engine

ENGINE_OPTS = dict(max_model_len=256, dtype="float32", max_num_seqs=8)
PROMPT = "hello world"
N_TOKENS = 8


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def omni(tiny_llm_assets):
    from vllm_omni import Omni

    engine = Omni(
        str(tiny_llm_assets.model_dir), enable_lora=True, max_lora_rank=16, max_loras=2, **ENGINE_OPTS
    )
    yield engine
    engine.shutdown()


def _ref(assets, name):
    adapter = None if name is None else getattr(assets, f"adapter_{name}")
    return hf_greedy(assets.model_dir, PROMPT, N_TOKENS, adapter)


def _variant(tmp_path, assets, name, weights=None, config=None):
    path = tmp_path / name
    shutil.copytree(assets.adapter_a, path, ignore=shutil.ignore_patterns(".complete", ".lock"))
    if weights is not None:
        tensors = load_file(path / "adapter_model.safetensors")
        save_file({k: weights(v) for k, v in tensors.items()}, path / "adapter_model.safetensors")
    if config is not None:
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg.update(config)
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    return str(path)


def test_same_id_with_another_path_is_refused_not_served_the_old_weights(omni, tiny_llm_assets):
    a = LoRARequest("a", 31, str(tiny_llm_assets.adapter_a))
    assert omni.generate(PROMPT, greedy(), lora_request=a)[0].token_ids == _ref(tiny_llm_assets, "a")
    b_as_31 = LoRARequest("b", 31, str(tiny_llm_assets.adapter_b))
    with pytest.raises(InvalidAdapterError, match="lora_int_id 31 already names adapter .*adapter_a"):
        omni.generate(PROMPT, greedy(), lora_request=b_as_31)
    with pytest.raises(InvalidAdapterError, match="lora_int_id 31 already names"):
        omni.add_lora(b_as_31)
    # the same directory spelled differently is the same adapter
    again = LoRARequest("a", 31, str(tiny_llm_assets.adapter_a) + "/")
    assert omni.generate(PROMPT, greedy(), lora_request=again)[0].token_ids == _ref(tiny_llm_assets, "a")
    # after an explicit removal the id may name another adapter, and serves its weights
    assert omni.remove_lora(31)
    out = omni.generate(PROMPT, greedy(), lora_request=b_as_31)[0].token_ids
    assert out == _ref(tiny_llm_assets, "b")
    omni.remove_lora(31)


def test_non_finite_adapters_are_refused_and_do_not_poison_other_adapters(omni, tiny_llm_assets, tmp_path):
    bad = {
        "nan_weights": (
            _variant(tmp_path, tiny_llm_assets, "nan", weights=lambda v: v * float("nan")),
            "NaN",
        ),
        "inf_weights": (_variant(tmp_path, tiny_llm_assets, "inf", weights=lambda v: v / 0.0), "NaN or inf"),
        "nan_alpha": (
            _variant(tmp_path, tiny_llm_assets, "alpha", config={"lora_alpha": float("nan")}),
            "alpha",
        ),
        "str_rank": (
            _variant(tmp_path, tiny_llm_assets, "rank", config={"r": "8"}),
            "'r' must be an integer",
        ),
    }
    for i, (label, (path, fragment)) in enumerate(bad.items()):
        request = LoRARequest(label, 60 + i, path)
        with pytest.raises(InvalidAdapterError, match=fragment):
            omni.generate(PROMPT, greedy(), lora_request=request)
        with pytest.raises(InvalidAdapterError, match=label):
            omni.add_lora(request)
    a = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    assert omni.generate(PROMPT, greedy(), lora_request=a)[0].token_ids == _ref(tiny_llm_assets, "a")
    assert omni.generate(PROMPT, greedy())[0].token_ids == _ref(tiny_llm_assets, None)


def test_n_sequences_with_an_adapter_returns_n_outputs(omni, tiny_llm_assets):
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4)
    a = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    for lora in (a, None):
        out = omni.generate(PROMPT, params, lora_request=lora)
        assert len(out[0].request_output.outputs) == 3
    assert params.n == 3 and params.output_kind.name == "CUMULATIVE"  # the caller's object is untouched


def test_wrong_argument_types_are_named(omni):
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        omni.generate(PROMPT, greedy(), lora_request="adapter_a")
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams"):
        omni.generate(PROMPT, {"max_tokens": 3})
    with pytest.raises(ValueError, match="prompts must be a string"):
        omni.generate(5, greedy())


def test_seed_outside_int64_is_refused_and_the_stage_keeps_serving(omni, tiny_llm_assets):
    """Such a seed failed the engine step, which killed the stage for every later request."""
    for seed in (2**80, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed must fit in int64"):
            omni.generate(PROMPT, SamplingParams(max_tokens=2, seed=seed))
    assert omni.generate(PROMPT, greedy())[0].token_ids == _ref(tiny_llm_assets, None)


def test_lora_call_waiting_while_the_stage_shuts_down_does_not_hang(tiny_llm_assets):
    """A LoRA call queued while the driver is inside a step, then shutdown: the call fails."""
    from vllm_omni import Omni

    engine = Omni(str(tiny_llm_assets.model_dir), enable_lora=True, max_lora_rank=16, **ENGINE_OPTS)
    runtime = engine._orchestrator.runtimes[0]
    in_step, release = threading.Event(), threading.Event()
    step = runtime._engine.step

    def slow_step():
        in_step.set()
        release.wait(600)
        return step()

    runtime._engine.step = slow_step
    fut = runtime.submit(StageRequest(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True)))
    assert in_step.wait(600)
    result: dict = {}

    def list_loras():
        try:
            result["value"] = runtime.list_loras()
        except Exception as exc:
            result["error"] = exc

    caller = threading.Thread(target=list_loras, daemon=True)
    caller.start()
    wait_until(lambda: runtime._commands, "the list_loras call to be queued", interval_s=0.01)
    closer = threading.Thread(target=engine.shutdown, daemon=True)
    closer.start()
    wait_until(lambda: runtime._closed, "the shutdown to begin", interval_s=0.01)
    release.set()
    closer.join(600)
    caller.join(600)
    assert not caller.is_alive(), "list_loras hung across shutdown"
    assert isinstance(result.get("error"), StageEngineError) or "value" in result
    with pytest.raises(StageEngineError):
        fut.result(timeout=300)


def test_calls_after_shutdown_fail_clearly(tiny_llm_assets):
    from vllm_omni import Omni

    engine = Omni(str(tiny_llm_assets.model_dir), enable_lora=True, max_lora_rank=16, **ENGINE_OPTS)
    engine.shutdown()
    a = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    for call in (
        lambda: engine.generate(PROMPT, greedy()),
        lambda: engine.add_lora(a),
        lambda: engine.list_loras(),
        lambda: engine.remove_lora(1),
    ):
        with pytest.raises(StageEngineError, match="shut down"):
            call()
