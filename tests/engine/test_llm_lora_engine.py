"""LLM stages on a real vLLM engine with real PEFT adapters, checked against transformers+peft."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm import SamplingParams

from tests.llm_reference import hf_greedy
from tests.waiting import wait_until
from vllm_omni.errors import InvalidAdapterError, LoRANotEnabledError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest, RequestAdapters

N_TOKENS = 10
PROMPTS = ["hello world", "the quick brown fox", "a b c"]
ENGINE_OPTS = dict(max_model_len=256, dtype="float32", max_num_seqs=8)

pytestmark = pytest.mark.engine


def greedy(n=N_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def omni(tiny_llm_assets):
    from vllm_omni import Omni

    engine = Omni(
        str(tiny_llm_assets.model_dir), enable_lora=True, max_lora_rank=16, max_loras=2, **ENGINE_OPTS
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def async_omni(tiny_llm_assets):
    """One ``AsyncOmni`` for the module's async tests (it takes the running loop per call, so each
    test's ``asyncio.run`` may use it); built once instead of once per test."""
    from vllm_omni import AsyncOmni

    engine = AsyncOmni(
        str(tiny_llm_assets.model_dir), enable_lora=True, max_lora_rank=16, max_loras=2, **ENGINE_OPTS
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def adapters(tiny_llm_assets):
    return {
        "a": LoRARequest("a", 1, str(tiny_llm_assets.adapter_a)),
        "b": LoRARequest("b", 2, str(tiny_llm_assets.adapter_b)),
    }


def _ref(assets, prompt, name):
    adapter = None if name is None else getattr(assets, f"adapter_{name}")
    return hf_greedy(assets.model_dir, prompt, N_TOKENS, adapter)


@pytest.mark.parametrize("name", [None, "a", "b"])
def test_greedy_parity_with_transformers_peft(omni, adapters, tiny_llm_assets, name):
    for prompt in PROMPTS[:2]:
        out = omni.generate(prompt, greedy(), lora_request=adapters.get(name))
        assert out[0].token_ids == _ref(tiny_llm_assets, prompt, name), (prompt, name)
    # the adapters really change the output (otherwise parity would prove nothing)
    if name is not None:
        assert _ref(tiny_llm_assets, PROMPTS[0], name) != _ref(tiny_llm_assets, PROMPTS[0], None)


def _mixed_requests(adapters):
    names = ["a", None, "b", None, "a", None]
    return names, [adapters[n] if n else None for n in names], [PROMPTS[i % 3] for i in range(len(names))]


def test_concurrent_mixed_adapters_each_equal_their_solo_output(omni, adapters, tiny_llm_assets):
    names, loras, prompts = _mixed_requests(adapters)
    outs = omni.generate(prompts, greedy(), lora_request=loras)
    for name, prompt, out in zip(names, prompts, outs):
        assert out.token_ids == _ref(tiny_llm_assets, prompt, name), (prompt, name)


def test_entry_stage_without_lora_names_stage_and_option(tiny_llm_assets, adapters, monkeypatch):
    import multiprocessing

    from vllm.v1.engine.core_client import InprocClient

    from vllm_omni import Omni

    # as in a fresh shell: the engine core still runs in this process (the inline backend's
    # default), and a value the user set is kept (test_mixed_lora_batch sets "1")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    children_before = {p.pid for p in multiprocessing.active_children()}
    with Omni(str(tiny_llm_assets.model_dir), **ENGINE_OPTS) as plain:
        assert isinstance(plain._orchestrator.runtimes[0]._engine.engine_core, InprocClient)
        assert {p.pid for p in multiprocessing.active_children()} <= children_before
        with pytest.raises(
            LoRANotEnabledError, match=r"Stage 0 \(llm_ar\) does not have LoRA enabled; set enable_lora=True"
        ):
            plain.generate("hi", greedy(), lora_request=adapters["a"])
        with pytest.raises(LoRANotEnabledError, match="no stage of pipeline 'default_llm' has LoRA enabled"):
            plain.list_loras()
        assert plain.generate("hello world", greedy())[0].token_ids == _ref(
            tiny_llm_assets, "hello world", None
        )


def _bad_adapters(tmp_path, assets):
    """name -> (path, expected message fragment)."""
    out = {
        "rank above max_lora_rank": (
            str(assets.adapter_rank64),
            "LoRA rank 64 is greater than max_lora_rank 16",
        )
    }
    missing = tmp_path / "missing"
    out["missing directory"] = (str(missing), "not a directory")

    wrong_rank = tmp_path / "wrong_rank"
    shutil.copytree(assets.adapter_a, wrong_rank)
    cfg = json.loads((wrong_rank / "adapter_config.json").read_text())
    cfg["r"] = 4
    (wrong_rank / "adapter_config.json").write_text(json.dumps(cfg))
    out["config rank != tensor rank"] = (str(wrong_rank), "expected (4, 128)")

    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(assets.adapter_a, wrong_shape)
    tensors = load_file(wrong_shape / "adapter_model.safetensors")
    tensors = {k: (torch.randn(v.shape[0], 64) if "lora_A" in k else v) for k, v in tensors.items()}
    save_file(tensors, wrong_shape / "adapter_model.safetensors")
    out["trained for another model size"] = (str(wrong_shape), "do not fit; expected (8, 128)")

    unknown = tmp_path / "unknown_module"
    shutil.copytree(assets.adapter_a, unknown)
    tensors = load_file(unknown / "adapter_model.safetensors")
    tensors = {k.replace("q_proj", "qq_proj"): v for k, v in tensors.items()}
    save_file(tensors, unknown / "adapter_model.safetensors")
    out["module absent from the model"] = (str(unknown), "self_attn.qq_proj: no linear layer of that name")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(assets.adapter_a / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    out["pickle only"] = (str(pickled), "pickle files ['adapter_model.bin'] are refused")

    no_alpha = tmp_path / "no_alpha"
    shutil.copytree(assets.adapter_a, no_alpha)
    cfg = json.loads((no_alpha / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (no_alpha / "adapter_config.json").write_text(json.dumps(cfg))
    out["no lora_alpha"] = (str(no_alpha), "has no lora_alpha")

    dora = tmp_path / "dora"
    shutil.copytree(assets.adapter_a, dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    out["DoRA"] = (str(dora), "DoRA")
    return out


def test_bad_adapters_fail_only_their_request_and_engine_keeps_serving(
    omni, adapters, tiny_llm_assets, tmp_path
):
    before = omni.list_loras()
    t0 = time.monotonic()  # how long the two good requests take now, on this machine at this load
    omni.generate("hello world", greedy(), lora_request=adapters["a"])
    omni.generate("hello world", greedy())
    prompt_s = max(30.0, 20 * (time.monotonic() - t0))
    for i, (label, (path, fragment)) in enumerate(_bad_adapters(tmp_path, tiny_llm_assets).items()):
        bad = LoRARequest(f"bad{i}", 100 + i, path)
        with pytest.raises(InvalidAdapterError) as info:
            omni.generate("hello world", greedy(), lora_request=bad)
        assert f"adapter 'bad{i}'" in str(info.value) and fragment in str(info.value), label
        with pytest.raises(InvalidAdapterError):
            omni.add_lora(bad)
        # the engine serves the next good-adapter and base requests correctly and promptly
        t0 = time.monotonic()
        good = omni.generate("hello world", greedy(), lora_request=adapters["a"])[0].token_ids
        base = omni.generate("hello world", greedy())[0].token_ids
        assert time.monotonic() - t0 < prompt_s, label  # no stall after the refusal
        assert good == _ref(tiny_llm_assets, "hello world", "a"), label
        assert base == _ref(tiny_llm_assets, "hello world", None), label
    assert omni.list_loras() <= before | {1, 2}


def test_runtime_lora_management(omni, adapters, tiny_llm_assets):
    c = LoRARequest("a-copy", 7, adapters["a"].lora_path)
    assert omni.add_lora(c) is True
    assert 7 in omni.list_loras()
    assert omni.pin_lora(7) is True
    out = omni.generate("hello world", greedy(), lora_request=c)[0].token_ids
    assert out == _ref(tiny_llm_assets, "hello world", "a")
    assert omni.remove_lora(7) is True
    assert 7 not in omni.list_loras()


def test_async_omni_concurrent_adapters(tiny_llm_assets, adapters, async_omni):
    engine = async_omni

    async def one(prompt, lora):
        outs = [o async for o in engine.generate(prompt, greedy(), lora_request=lora)]
        assert len(outs) == 1
        return outs[0].token_ids

    async def main():
        names = ["a", None, "b", "a", None]
        results = await asyncio.gather(*(one(PROMPTS[i % 3], adapters.get(n)) for i, n in enumerate(names)))
        for i, (n, r) in enumerate(zip(names, results)):
            assert r == _ref(tiny_llm_assets, PROMPTS[i % 3], n), (i, n)
        assert await engine.add_lora(LoRARequest("b2", 9, adapters["b"].lora_path))
        assert 9 in await engine.list_loras()
        with pytest.raises(InvalidAdapterError):
            await one("hi", LoRARequest("bad", 10, str(tiny_llm_assets.adapter_rank64)))
        assert await one("hello world", None) == _ref(tiny_llm_assets, "hello world", None)
        assert await engine.remove_lora(9)  # the shared engine as the other tests expect it

    asyncio.run(main())


def test_cancelled_request_is_aborted_and_engine_keeps_serving(omni, adapters, tiny_llm_assets):
    runtime = omni._orchestrator.runtimes[0]
    fut = runtime.submit(
        StageRequest(
            "hello world",
            SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
            RequestAdapters.of(adapters["a"]),
        )
    )
    steps = _count_steps(runtime)
    assert fut.cancel() or fut.done()
    wait_until(lambda: not runtime._running, "the engine to drop the cancelled request", describe=steps)
    # aborted, not run out: its 200 tokens would take 200 engine steps
    assert steps() < 50, f"the cancelled request ran {steps()} more engine steps"
    assert omni.generate("hello world", greedy())[0].token_ids == _ref(tiny_llm_assets, "hello world", None)


def _count_steps(runtime):
    """Count the engine's steps from now on; returns a function that reads the count."""
    engine, count = runtime._engine, [0]
    step = engine.step

    def counted():
        count[0] += 1
        return step()

    engine.step = counted
    return lambda: count[0]


def _wait_running(runtime, fut):
    wait_until(
        lambda: any(item.future is fut for item in list(runtime._running.values())),
        "the request to reach the engine",
        interval_s=0.002,
    )


def test_request_cancelled_while_running_is_aborted_and_its_batch_mates_finish(omni, tiny_llm_assets):
    runtime = omni._orchestrator.runtimes[0]
    with runtime.hold():  # both start in one step
        doomed = runtime.submit(
            StageRequest(
                "the quick brown fox", SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            )
        )
        mate = runtime.submit(
            StageRequest("hello world", SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        )
    _wait_running(runtime, doomed)
    assert doomed.cancel()
    mate_tokens = mate.result(timeout=600).outputs[0].token_ids
    # aborted within a step of the cancel, long before its 200 tokens (the mate took 60 steps)
    assert not any(item.future is doomed for item in list(runtime._running.values()))
    assert mate_tokens[:N_TOKENS] == _ref(tiny_llm_assets, "hello world", None)


def test_request_submitted_while_others_run_joins_at_the_next_step(omni, tiny_llm_assets):
    """The driver steps without taking its lock while nothing else is pending; new work is still seen."""
    runtime = omni._orchestrator.runtimes[0]
    long = runtime.submit(
        StageRequest("a b c", SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    )
    _wait_running(runtime, long)
    short = runtime.submit(StageRequest("hello world", greedy()))
    assert short.result(timeout=600).outputs[0].token_ids == _ref(tiny_llm_assets, "hello world", None)
    assert not long.done(), "the short request waited for the long one"
    assert len(long.result(timeout=900).outputs[0].token_ids) == 200


def test_a_bad_adapter_in_a_prompt_list_fails_before_any_request_is_queued(omni, adapters, tiny_llm_assets):
    runtime = omni._orchestrator.runtimes[0]
    submitted = []
    original = runtime.submit
    runtime.submit = lambda *a, **k: submitted.append(a) or original(*a, **k)
    try:
        bad = LoRARequest("bad", 55, str(tiny_llm_assets.adapter_rank64))
        with pytest.raises(InvalidAdapterError, match="adapter 'bad'"):
            omni.generate(PROMPTS[:2], greedy(), lora_request=[adapters["a"], bad])
        assert submitted == []
    finally:
        del runtime.submit


def test_async_generate_cancelled_by_its_caller_aborts_the_stage_request(tiny_llm_assets, async_omni):
    """A client that goes away (its task is cancelled) must not leave its request running in the engine."""
    engine = async_omni
    runtime = engine._orchestrator.runtimes[0]
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stage_futures = []
    original = runtime.submit
    runtime.submit = lambda *a, **k: stage_futures.append(original(*a, **k)) or stage_futures[-1]

    async def consume():
        return [o async for o in engine.generate("the quick brown fox", long)]

    async def main():
        task = asyncio.ensure_future(consume())
        t0 = time.monotonic()
        while not runtime._running:  # progress: the engine holds it (the cap only bounds a failure)
            assert time.monotonic() - t0 < 600, "the request never reached the engine"
            await asyncio.sleep(0.005)
        steps = _count_steps(runtime)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        t0 = time.monotonic()
        while runtime._running and time.monotonic() - t0 < 600:
            await asyncio.sleep(0.01)
        assert not runtime._running, "the abandoned request is still running in the engine"
        assert steps() < 50, f"the abandoned request ran {steps()} more engine steps"  # not its 400
        assert not runtime._engine.has_unfinished_requests()
        # it was stopped, not run out to its 400 tokens
        assert stage_futures[0].cancelled(), "the stage request was not cancelled with its caller"
        outs = [o async for o in engine.generate("hello world", greedy())]
        assert outs[0].token_ids == _ref(tiny_llm_assets, "hello world", None)

    try:
        asyncio.run(main())
    finally:
        del runtime.submit  # the shared engine's own method again


def test_async_generate_streams_delta_pieces_that_add_up_to_the_final_output(adapters, async_omni):
    """DELTA params: one output per engine step (as vLLM's AsyncLLM); the pieces of each completion
    add up to what the same request returns in one final output (n=2, with an adapter)."""
    from vllm.sampling_params import RequestOutputKind

    engine = async_omni
    kw = dict(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)

    async def main():
        final = [
            o async for o in engine.generate("hello world", SamplingParams(**kw), lora_request=adapters["a"])
        ]
        delta = SamplingParams(**kw, output_kind=RequestOutputKind.DELTA)
        pieces = [
            o.request_output async for o in engine.generate("hello world", delta, lora_request=adapters["a"])
        ]
        return final, pieces

    final, pieces = asyncio.run(main())
    [complete] = [o.request_output for o in final]
    assert len(pieces) >= 12 and pieces[-1].finished and not any(p.finished for p in pieces[:-1])
    for c in complete.outputs:
        mine = [o for p in pieces for o in p.outputs if o.index == c.index]
        assert sum((list(o.token_ids) for o in mine), []) == list(c.token_ids)
        assert "".join(o.text for o in mine) == c.text
        assert mine[-1].finish_reason == c.finish_reason == "length"


@pytest.mark.parametrize("change", ["new_version", "remove_and_delete"])
def test_a_running_request_keeps_its_adapter_version_to_the_end(omni, tiny_llm_assets, tmp_path, change):
    """Issue 21 rule 1 for requests in flight: a new version registered under the name (files rewritten
    in place, ``add_lora(reload=True)``), or ``remove_lora`` followed by deleting the files, while a
    request of the old version runs. vLLM's worker would load the running request's adapter again from
    its path: the new files (tokens of two adapters) or none (an invalid adapter stalls the engine).
    The stage removes the old version from the engine once its last request finished; the request's
    tokens equal transformers+peft with the old adapter throughout."""
    n = 120
    path = tmp_path / "v"
    shutil.copytree(tiny_llm_assets.adapter_a, path)
    lora = LoRARequest("v", 40, str(path))
    runtime = omni._orchestrator.runtimes[0]
    assert omni.add_lora(lora)
    old = omni.adapter_registry.get("v").engine
    steps = _count_steps(runtime)
    try:
        fut = runtime.submit(StageRequest("hello world", greedy(n), RequestAdapters.of(old)))
        _wait_running(runtime, fut)
        if change == "new_version":
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copyfile(tiny_llm_assets.adapter_b / name, path / name)
            assert omni.add_lora(lora, reload=True)
            new = omni.adapter_registry.get("v").engine
            assert new.lora_int_id != old.lora_int_id
        else:
            assert omni.remove_lora(40)
            shutil.rmtree(path)
        at_change = steps()
        assert old.lora_int_id not in runtime.list_loras()  # removed as far as callers can see
        tokens = list(fut.result(timeout=900).outputs[0].token_ids)
        assert at_change < n, "the request finished before the change; nothing was tested"
        assert tokens == hf_greedy(tiny_llm_assets.model_dir, "hello world", n, tiny_llm_assets.adapter_a)
        wait_until(lambda: old.lora_int_id not in runtime._engine.list_loras(), "the deferred removal")
        if change == "new_version":
            assert omni.generate("hello world", greedy(), lora_request=lora)[0].token_ids == _ref(
                tiny_llm_assets, "hello world", "b"
            )
    finally:
        del runtime._engine.step
        omni.remove_lora(40)
