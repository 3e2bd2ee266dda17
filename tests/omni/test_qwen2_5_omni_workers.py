"""Qwen2.5-Omni's talker and code2wav stages under the supervised worker runtime.

With ``worker_backend="mp"`` every stage, the talker and code2wav included, runs in a worker
process of its own; ``kill -9`` of the talker's or of code2wav's worker restarts it, and the
next request's text, codec tokens and waveform equal those before the kill (and transformers'
``generate``). Under ``"ray"`` the talker and code2wav each run in an actor of their own:
killing the actor's process restarts it, and the codes of the same thinker output / the
waveform of the same codes are unchanged.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from stage_workers import kill_and_wait_restart, kill_ray_actor_and_wait_restart
from test_qwen2_5_omni_audio import PROMPTS, _params, hf_reference

from vllm_omni.engine.workers.client import WorkerStageRuntime
from vllm_omni.inputs.stage_request import StageRequest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

LLM_OPTIONS = {"dtype": "float32", "max_model_len": 256, "enable_lora": True, "max_lora_rank": 16}
OVERRIDES = {
    "0": LLM_OPTIONS | {"limit_mm_per_prompt": {"image": 0, "video": 0, "audio": 0}},
    "1": LLM_OPTIONS | {"restart_backoff_s": 0.1},
    "2": {"restart_backoff_s": 0.1},
}


@pytest.fixture(scope="module")
def omni(tiny_omni_assets):
    from vllm_omni import Omni

    with Omni(
        str(tiny_omni_assets.model_dir),
        pipeline="qwen2_5_omni",
        stage_overrides=OVERRIDES,
        worker_backend="mp",
    ) as engine:
        yield engine


def _run(omni):
    text, audio = omni.generate({"prompt_token_ids": list(PROMPTS[0])}, _params())
    return text.token_ids, audio.stage_outputs[1].codes.tolist(), audio.audio


@pytest.fixture(scope="module")
def before(omni, tiny_omni_assets):
    """Text, codes and waveform before any kill, checked against transformers."""
    tokens, codes, wav = _run(omni)
    ref_tokens, ref_codes, ref_wav = hf_reference(str(tiny_omni_assets.model_dir), PROMPTS[0])
    assert tokens == ref_tokens and codes == ref_codes and len(codes) > 0
    # code2wav's worker has its own CPU thread count (the pipeline's thread plan), so float32 sums
    # are ordered differently than in this process: measured 5.7e-5 at most on a waveform of
    # amplitude 1 (the inline test holds 1e-5)
    np.testing.assert_allclose(wav, ref_wav, rtol=0, atol=2e-4)
    return tokens, codes, wav


def test_every_stage_runs_in_its_own_worker(omni):
    pids = [runtime.pid for runtime in omni._orchestrator.runtimes]
    assert all(isinstance(runtime, WorkerStageRuntime) for runtime in omni._orchestrator.runtimes)
    assert len(set(pids)) == 3 and os.getpid() not in pids


@pytest.mark.parametrize("stage_id", [1, 2], ids=["talker", "code2wav"])
def test_kill_9_restarts_the_stage_and_the_output_is_unchanged(omni, before, stage_id):
    kill_and_wait_restart(omni, stage_id, lambda: _run(omni))
    tokens, codes, wav = _run(omni)
    assert tokens == before[0] and codes == before[1]
    np.testing.assert_array_equal(wav, before[2])


@pytest.mark.parametrize("stage_id", [1, 2], ids=["talker", "code2wav"])
def test_kill_9_of_a_ray_actor_restarts_it_with_the_same_output(omni, before, stage_id):
    """The talker's / code2wav's stage config in a Ray actor of its own, fed what the stage before
    it produced in the mp run: its codes / waveform before and after the actor's process is killed."""
    from vllm_omni.engine.inline_runtime import runtime_factory
    from vllm_omni.engine.workers.ray_backend import RayStageRuntime
    from vllm_omni.stages.qwen2_5_omni.pipeline import talker2code2wav, thinker2talker

    text, audio = omni.generate({"prompt_token_ids": list(PROMPTS[0])}, _params())
    params = _params()
    if stage_id == 1:
        payload = thinker2talker(audio.stage_outputs[0], params, None)
    else:
        payload = talker2code2wav(audio.stage_outputs[1], params, None)
    stage = omni._orchestrator.config.stages[stage_id]
    label = r"Stage 1 \(llm_ar\)" if stage_id == 1 else r"Stage 2 \(llm_generation\)"

    def output():
        out = runtime.submit(StageRequest(payload, params[stage_id])).result(timeout=600)
        return out.codes.tolist() if stage_id == 1 else out.waveform

    runtime = RayStageRuntime(stage, config=omni._orchestrator.config, factory=runtime_factory(stage))
    try:
        assert runtime.info["pid"] != os.getpid()
        first = output()
        if stage_id == 1:
            assert first == before[1]  # the same codes as the mp talker (and transformers)
        else:  # the actor's torch uses every core, the mp worker its share: sums ordered differently
            np.testing.assert_allclose(first, before[2], rtol=0, atol=2e-4)
        kill_ray_actor_and_wait_restart(runtime, output, label)
        again = output()
        if stage_id == 1:
            assert again == first
        else:
            np.testing.assert_array_equal(again, first)
    finally:
        runtime.shutdown()
