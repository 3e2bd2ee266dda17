"""Qwen3-Omni served with a talker adapter, every stage in a worker process of its own.

One engine for the module: ``vllm-omni serve <tiny Qwen3-Omni> --worker-backend mp`` as the CLI
parses it, its app in this process (httpx's ASGI transport: no second engine, no server process).
A talker adapter is registered on stage 1 (``add_lora(..., stage_id=1)``, pinned).

- ``worker_backend="mp"``: the thinker, the talker and code2wav each run in their own process;
  ``kill -9`` of the talker's or of code2wav's worker restarts it, the restarted talker holds the
  registered adapter again (loaded and pinned, before any request names it), and the next
  request's text, codes and waveform equal those before the kill, which equal transformers'
  ``generate`` with peft's adapter on ``model.talker`` (greedy, float32).
- ``worker_backend="ray"``: the talker with its adapter in a Ray actor; ``kill -9`` of the actor's
  process restarts it holding the adapter, and its codes are unchanged.
- HTTP: a chat completion with ``modalities: ["text", "audio"]`` and the talker adapter given in
  the ``lora`` field for stage 1 answers the text and the waveform (16-bit WAV) of the same
  request made in Python. An adapter for another model (the thinker's, on stage 1) or for a
  stage without LoRA (code2wav) is a 400 naming the adapter or the stage; nothing is registered
  or loaded because of it, and the next request is a 200 with the same answer.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import wave

import httpx
import numpy as np
import pytest
import torch
from stage_workers import kill_and_wait_restart, kill_ray_actor_and_wait_restart
from test_qwen3_omni_pipeline import WAVE_ATOL, _params, assert_audible, reference
from vllm import SamplingParams

from tests.conftest import test_assets_root
from vllm_omni.engine.workers.client import WorkerStageRuntime
from vllm_omni.inputs.audio import AudioParams
from vllm_omni.lora.request import LoRARequest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

OVERRIDES = {
    "0": {"dtype": "float32", "max_model_len": 256},
    "1": {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "restart_backoff_s": 0.1},
    "2": {"restart_backoff_s": 0.1},
}
TALKER_ID = 11
USER = "Once upon a time"
#: an HTTP request's talker samples with transformers' talker defaults (the server has no field for
#: the talker's params) and the request's seed; this seed ends the tiny talker's codes early
SEED = 8


def _transformers_talker_defaults() -> dict:
    """The ``talker_*`` defaults of transformers' ``Qwen3OmniMoeForConditionalGeneration.generate``, as
    ``SamplingParams`` fields (read from transformers, the reference, not from the stage)."""
    import inspect

    from transformers import Qwen3OmniMoeForConditionalGeneration

    params = inspect.signature(Qwen3OmniMoeForConditionalGeneration.generate).parameters
    names = {"temperature": "talker_temperature", "top_k": "talker_top_k", "top_p": "talker_top_p"}
    names |= {"repetition_penalty": "talker_repetition_penalty", "max_tokens": "talker_max_new_tokens"}
    return {field: params[name].default for field, name in names.items()}


@pytest.fixture(scope="module")
def assets():
    from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets

    return ensure_tiny_qwen3_omni_assets(test_assets_root())


@pytest.fixture(scope="module")
def prompt(assets):
    """``(chat prompt ids, <|im_end|> id)`` from the checkpoint's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(assets.model_dir))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": USER}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tuple(ids), tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.fixture(scope="module")
def talker_lora(assets):
    return LoRARequest("talker", TALKER_ID, str(assets.talker_adapter))


@pytest.fixture(scope="module")
def served(assets, talker_lora):
    """``(AsyncOmni, app)`` of ``serve <folder> --worker-backend mp`` (the adapters' folder allowed)."""
    from vllm_omni.entrypoints.async_omni import AsyncOmni
    from vllm_omni.entrypoints.cli.serve import parse_serve_argv
    from vllm_omni.entrypoints.openai.api_server import build_app, make_state, register_startup_adapters

    argv = [str(assets.model_dir), "--worker-backend", "mp", "--stage-overrides", json.dumps(OVERRIDES)]
    argv += ["--served-model-name", "tiny-qwen3-omni", "--lora-dirs", str(assets.talker_adapter.parent)]
    launch, settings = parse_serve_argv(argv)
    omni = AsyncOmni.from_config(launch.build_config())
    try:
        state = make_state(omni, settings)
        asyncio.run(register_startup_adapters(state))
        assert asyncio.run(omni.add_lora(talker_lora, stage_id=1))
        assert asyncio.run(omni.pin_lora(TALKER_ID, stage_id=1))
        yield omni, build_app(state)
    finally:
        omni.shutdown()


@pytest.fixture(scope="module")
def omni(served):
    return served[0]


def _generate(omni, prompt, params, lora):
    """``(text output, audio output)`` of one request through ``AsyncOmni.generate``."""

    async def main():
        request = omni.generate({"prompt_token_ids": list(prompt[0])}, params, lora_request=lora)
        return [out async for out in request]

    text, audio = asyncio.run(main())
    return text, audio


def _run(omni, prompt, lora):
    """Greedy thinker and talker: ``(text ids, codes, waveform)``."""
    text, audio = _generate(omni, prompt, _params(), {1: lora})
    return text.token_ids, audio.stage_outputs[1].codes, audio.audio


@pytest.fixture(scope="module")
def before(omni, assets, prompt, talker_lora):
    """Text, codes and waveform before any kill, checked against transformers + peft (that the adapter
    changes the codes is checked in ``test_qwen3_omni_pipeline.py``)."""
    tokens, codes, wav = _run(omni, prompt, talker_lora)
    model = str(assets.model_dir)
    ref_tokens, ref_codes, ref_wav = reference(model, *prompt, "Ethan", None, str(assets.talker_adapter))
    assert tokens == ref_tokens and codes.shape[1] > 0 and torch.equal(codes, ref_codes)
    # code2wav's worker runs its own CPU thread count (the pipeline's thread plan), so its float32
    # sums may be ordered differently than in this process: the inline test's tolerance covers that
    # (measured 0.0 here too), on a reference that is neither saturated nor silent
    assert_audible(ref_wav)
    np.testing.assert_allclose(wav, ref_wav, rtol=0, atol=WAVE_ATOL)
    return tokens, codes, wav


def _talker_holds_the_adapter(omni) -> bool:
    talker = omni._orchestrator.runtimes[1]
    stats = talker.stats().adapters.get("talker")
    return TALKER_ID in talker.list_loras() and stats is not None and stats.loaded and stats.pinned


def test_every_stage_runs_in_its_own_worker(omni):
    runtimes = omni._orchestrator.runtimes
    assert all(isinstance(runtime, WorkerStageRuntime) for runtime in runtimes)
    pids = [runtime.pid for runtime in runtimes]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert _talker_holds_the_adapter(omni)


@pytest.mark.parametrize("stage_id", [1, 2], ids=["talker", "code2wav"])
def test_kill_9_restarts_the_stage_with_its_adapter_and_the_output_is_unchanged(
    omni, before, prompt, talker_lora, stage_id
):
    kill_and_wait_restart(omni, stage_id, lambda: _run(omni, prompt, talker_lora))
    assert _talker_holds_the_adapter(omni)  # restored by the restart, before any request names it
    assert omni.adapter_registry.failed() == {}
    tokens, codes, wav = _run(omni, prompt, talker_lora)
    assert tokens == before[0] and torch.equal(codes, before[1])
    np.testing.assert_array_equal(wav, before[2])


def test_talker_in_a_ray_actor_restarts_with_its_adapter_and_the_same_codes(
    omni, before, prompt, talker_lora
):
    """``worker_backend="ray"``: the talker's stage config in a Ray actor of its own, its adapter added
    and pinned, fed the thinker output of the mp run: the codes equal the mp talker's (== transformers +
    peft); after ``kill -9`` of the actor's process a call fails with ``StageDeadError`` naming the stage,
    the actor comes back holding the adapter, and the codes are unchanged."""

    from vllm_omni.engine.inline_runtime import runtime_factory
    from vllm_omni.engine.workers.ray_backend import RayStageRuntime
    from vllm_omni.inputs.stage_request import StageRequest
    from vllm_omni.lora.request import RequestAdapters
    from vllm_omni.stages.qwen2_5_omni.pipeline import thinker2talker

    pytest.importorskip("ray")
    params = _params()
    text, _ = _generate(omni, prompt, params, {1: talker_lora})
    payload = thinker2talker(text.request_output, params, None)
    config = omni._orchestrator.config
    stage = config.stages[1]

    def codes():
        request = StageRequest(payload, params[1], RequestAdapters.of(talker_lora))
        return runtime.submit(request).result(timeout=600).codes

    runtime = RayStageRuntime(stage, config=config, factory=runtime_factory(stage))
    try:
        assert runtime.info["pid"] != os.getpid()
        assert runtime.add_lora(talker_lora) and runtime.pin_lora(TALKER_ID)
        assert torch.equal(codes(), before[1])
        kill_ray_actor_and_wait_restart(runtime, codes, r"Stage 1 \(llm_ar\)")
        assert TALKER_ID in runtime.list_loras()
        assert torch.equal(codes(), before[1])
    finally:
        runtime.shutdown()


# ---------------------------------------------------------------------------- HTTP


def _chat(app, lora):
    """POST ``/v1/chat/completions`` asking for text and audio; the response."""
    body = {
        "model": "tiny-qwen3-omni",
        "messages": [{"role": "user", "content": USER}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": "wav"},
        "max_tokens": 8,
        "temperature": 0,
        "seed": SEED,
        "lora": lora,
    }

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=600) as client:
            return await client.post("/v1/chat/completions", json=body)

    return asyncio.run(main())


def _pcm(reply) -> np.ndarray:
    with wave.open(io.BytesIO(base64.b64decode(reply["audio"]["data"]))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


@pytest.fixture(scope="module")
def offline(omni, prompt, talker_lora):
    """``(text, 16-bit samples)`` of the HTTP request made in Python: greedy thinker, the talker with
    transformers' defaults, all seeded, the talker adapter on stage 1."""
    params = [
        SamplingParams(temperature=0, max_tokens=8, seed=SEED),
        SamplingParams(**_transformers_talker_defaults(), seed=SEED),
        AudioParams(voice="ethan", seed=SEED),
    ]
    text, audio = _generate(omni, prompt, params, {1: talker_lora})
    assert 0 < audio.stage_outputs[1].codes.shape[1] < 100  # the seed keeps the sampled talker short
    pcm = (np.clip(audio.audio, -1, 1) * 32767).round().astype("<i2")
    return text.request_output.outputs[0].text, pcm


def _talker_entry(assets):
    return {"name": "talker", "path": str(assets.talker_adapter), "stage": 1}


def test_audio_chat_with_a_talker_adapter_equals_the_python_request(served, assets, offline):
    response = _chat(served[1], [_talker_entry(assets)])
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["content"] is None and message["audio"]["transcript"] == offline[0] != ""
    pcm = _pcm(message)
    assert pcm.size > 0 and np.abs(pcm).max() > 0
    np.testing.assert_array_equal(pcm, offline[1])


@pytest.mark.parametrize("wrong", ["model", "stage"])
def test_adapter_for_the_wrong_model_or_stage_is_400_naming_it_then_200(served, assets, offline, wrong):
    omni, app = served
    if wrong == "model":  # the thinker's adapter on the talker
        entry = {"name": "bad_thinker", "path": str(assets.thinker_adapter), "stage": 1}
        names = ["'bad_thinker'", "Stage 1 (llm_ar)", "'thinker.model.layers.0.self_attn.q_proj'"]
    else:  # the talker's adapter on code2wav, which takes none
        entry = {"name": "talker_on_code2wav", "path": str(assets.talker_adapter), "stage": 2}
        names = ["Stage 2 (llm_generation)", "enable_lora"]
    talker = omni._orchestrator.runtimes[1]
    loaded = talker.list_loras()
    response = _chat(app, [entry])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora" and all(n in error["message"] for n in names), error
    assert omni.adapter_registry.get(entry["name"]) is None and talker.list_loras() == loaded  # nothing lost
    assert TALKER_ID in loaded
    response = _chat(app, [_talker_entry(assets)])
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["audio"]["transcript"] == offline[0]
    np.testing.assert_array_equal(_pcm(message), offline[1])
