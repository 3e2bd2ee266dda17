"""``worker_backend="mp"`` on ``llm_chain``: each stage's vLLM engine in its own worker process.

Parity with the inline backend (same token ids, adapter on the entry stage), error classes
crossing the process boundary, streaming, cancellation, and recovery from ``kill -9``.
One inline pipeline (the reference) runs first and is shut down; one ``mp`` pipeline then
serves every test of the module.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from tests.waiting import wait_until
from vllm_omni.errors import InvalidAdapterError, InvalidRequestError, LoRANotEnabledError, StageDeadError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest

pytestmark = pytest.mark.engine

N = 8
PROMPTS = ["hello world", "the cat sat", "one two three"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


def _deploy(path, model: str) -> str:
    path.write_text(
        "pipeline: llm_chain\n"
        "stages:\n"
        f"  - stage_id: 0\n    model: {model}\n    enable_lora: true\n    max_lora_rank: 16\n"
        "    max_cpu_loras: 2\n    engine_extras: {max_model_len: 256, dtype: float32}\n"
        f"  - stage_id: 1\n    model: {model}\n    max_model_len: 256\n    dtype: float32\n"
    )
    return str(path)


def _token_ids(outputs) -> list[tuple[list[int], list[int]]]:
    return [(list(o.stage_outputs[0].outputs[0].token_ids), list(o.token_ids)) for o in outputs]


def _run(omni, adapter) -> list[tuple[list[int], list[int]]]:
    return _token_ids(omni.generate(PROMPTS, [GREEDY, GREEDY], lora_request=adapter, use_tqdm=False))


@pytest.fixture(scope="module")
def deploy(tiny_llm_assets, tmp_path_factory):
    return _deploy(tmp_path_factory.mktemp("chain") / "chain.yaml", str(tiny_llm_assets.model_dir))


@pytest.fixture(scope="module")
def adapter_a(tiny_llm_assets):
    return LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))


@pytest.fixture(scope="module")
def reference(deploy, adapter_a):
    from vllm_omni import Omni

    with Omni(deploy_config=deploy) as omni:
        return _run(omni, adapter_a)


@pytest.fixture(scope="module")
def omni(deploy, reference):
    from vllm_omni import Omni

    omni = Omni(deploy_config=deploy, worker_backend="mp")
    yield omni
    pids = [rt.pid for rt in omni._orchestrator.runtimes]
    omni.shutdown()
    for pid in pids:
        assert not _alive(pid), f"worker {pid} outlived Omni.shutdown()"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_outputs_equal_the_inline_backend(omni, reference, adapter_a):
    pids = [rt.pid for rt in omni._orchestrator.runtimes]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert omni.stage_health() == {0: "ready", 1: "ready"}
    assert _run(omni, adapter_a) == reference
    assert omni.list_loras() == {1}


def test_an_adapter_in_memory_crosses_without_a_file(omni, reference, tiny_llm_assets):
    """Issue 40: a ``TensorLoRARequest`` (adapter_a's config and tensors, keys without peft's prefix)
    reaches the worker's vLLM engine through shared memory and serves adapter_a's tokens."""
    import json

    from safetensors.torch import load_file

    from vllm_omni.lora.request import TensorLoRARequest

    folder = tiny_llm_assets.adapter_a
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    lora = TensorLoRARequest(
        lora_name="a_in_memory",
        lora_int_id=3,
        peft_config=json.loads((folder / "adapter_config.json").read_text()),
        lora_tensors={k.removeprefix("base_model.model."): v for k, v in tensors.items()},
    )
    assert omni.add_lora(lora)
    assert _run(omni, lora) == reference
    assert omni.remove_lora(3)


def test_errors_keep_their_class_across_the_process(omni, tiny_llm_assets):
    with pytest.raises(
        InvalidAdapterError, match="rank"
    ):  # rank 64 > max_lora_rank 16, refused in the worker
        omni.add_lora(LoRARequest("big", 9, str(tiny_llm_assets.adapter_rank64)), stage_id=0)
    with pytest.raises(LoRANotEnabledError, match=r"Stage 1"):
        omni.add_lora(LoRARequest("a", 1, str(tiny_llm_assets.adapter_a)), stage_id=1)
    # refused by stage 1: rolled back in stage 0's worker process (issue 21, rule 2)
    with pytest.raises(LoRANotEnabledError, match=r"adapter 'both' .*Stage 1"):
        omni.add_lora(LoRARequest("both", 5, str(tiny_llm_assets.adapter_b)), stage_id=[0, 1])
    assert 5 not in omni.list_loras(stage_id=0) and omni.adapter_registry.get("both") is None
    bad_seed = SamplingParams(max_tokens=2, seed=2**70)
    with pytest.raises(InvalidRequestError, match="int64"):
        omni.generate("hi", [bad_seed, GREEDY], use_tqdm=False)
    runtime = omni._orchestrator.runtimes[0]
    with pytest.raises(InvalidRequestError, match="int64"):  # submit raises synchronously too
        runtime.submit(StageRequest("hi", bad_seed))


def _stream(runtime, prompt: str, max_tokens: int, on_piece=None):
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    pieces = []

    def on_partial(out):
        pieces.append(out)
        if on_piece is not None:
            on_piece(out)

    return runtime.submit(StageRequest(prompt, params, on_partial=on_partial)), pieces


def test_streaming_pieces_add_up_to_the_output(omni):
    fut, pieces = _stream(omni._orchestrator.runtimes[1], "hello world", N)
    final = fut.result(timeout=300)
    assert len(pieces) >= 2 and pieces[-1].finished
    assert [t for p in pieces for t in p.outputs[0].token_ids] == list(final.outputs[0].token_ids)
    assert len(final.outputs[0].token_ids) == N


def test_cancel_aborts_the_request_in_the_worker(omni):
    started = threading.Event()
    fut, pieces = _stream(omni._orchestrator.runtimes[1], "hello world", 240, lambda _: started.set())
    assert started.wait(600)
    assert fut.cancel()
    # progress, not time: a whole request through both stages goes after the abort, so the engine
    # has stepped many times since; a request still running would have streamed pieces meanwhile
    assert omni.generate("hi", [GREEDY, GREEDY], use_tqdm=False)  # the stage still serves
    seen = len(pieces)
    assert omni.generate("hello", [GREEDY, GREEDY], use_tqdm=False)
    assert len(pieces) == seen < 240  # no more pieces: the engine dropped the request
    assert not any(p.finished for p in pieces)


def _pin_probe(omni, tiny_llm_assets) -> tuple[str, set[int]]:
    """What adding a third adapter does (the cache holds 2 and one is pinned), and the ids after."""
    try:
        omni.add_lora(LoRARequest("c", 3, str(tiny_llm_assets.adapter_b)), stage_id=0)
        outcome = "added"
    except RuntimeError as exc:
        outcome = str(exc)
    return outcome, omni.list_loras(stage_id=0)


@pytest.mark.slow
def test_kill_9_fails_in_flight_then_the_stage_recovers(omni, reference, adapter_a, tiny_llm_assets):
    rt0, rt1 = omni._orchestrator.runtimes
    adapter_b = LoRARequest("b", 2, str(tiny_llm_assets.adapter_b))
    assert omni.add_lora(adapter_a, stage_id=0)
    assert omni.add_lora(adapter_b, stage_id=0)
    assert omni.pin_lora(1, stage_id=0)
    loras = omni.list_loras(stage_id=0)
    assert loras == {1, 2}
    pinned = _pin_probe(omni, tiny_llm_assets)
    assert "pinned" in pinned[0]  # vLLM refuses a third adapter because of the pin

    started = threading.Event()
    doomed = [_stream(rt0, p, 240, lambda _: started.set())[0] for p in PROMPTS]
    survivor, _ = _stream(rt1, "the other stage", 64)
    assert started.wait(600)
    pid = rt0.pid
    os.kill(pid, signal.SIGKILL)
    for fut in doomed:
        with pytest.raises(StageDeadError, match=rf"Stage 0 \(llm_ar\).*pid {pid}, killed by signal SIGKILL"):
            fut.result(timeout=300)
    assert len(survivor.result(timeout=300).outputs[0].token_ids) == 64  # stage 1 kept serving
    # while stage 0 is down: no hang, a clear error, and health says so
    assert omni.stage_health()[0] == "restarting" and omni.stage_health()[1] == "ready"
    with pytest.raises(StageDeadError, match=r"Stage 0 \(llm_ar\) is restarting"):
        omni.generate("hi", [GREEDY, GREEDY], use_tqdm=False)
    # no hang: the refusal came back before the restart (a whole engine start) finished
    assert omni.stage_health()[0] == "restarting"

    wait_until(lambda: omni.stage_health()[0] == "ready", "stage 0 to come back", cap_s=900,
               describe=omni.stage_health)  # fmt: skip
    assert omni.stage_health() == {0: "ready", 1: "ready"}
    assert rt0.pid != pid and rt0.restarts == 1
    assert omni.list_loras(stage_id=0) == loras  # the run-time adapters came back
    assert _pin_probe(omni, tiny_llm_assets) == pinned  # the pin came back too
    assert _run(omni, adapter_a) == reference  # correct answers after recovery
