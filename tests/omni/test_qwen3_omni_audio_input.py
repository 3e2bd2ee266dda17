"""The ``qwen3_omni_thinker_only`` pipeline with one audio clip through vLLM's multimodal path (on a
CPU install: the processor built without its video processor) against transformers' thinker fed
the checkpoint's Whisper features of the same clip: prompt ids, greedy tokens and their logprobs.
The tiny random MoE thinker answers the same token to most prompts, so the logprobs (which the
clip changes) are what tells the audio reached the decoder."""

from __future__ import annotations

import pytest
import torch
from omni_reference import qwen3_omni_audio_inputs, sine_noise_clip, thinker

from tests.conftest import test_assets_root

N = 4
BEFORE, AFTER = "Listen:", " What is it?"


@pytest.fixture(scope="module")
def assets():
    from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets

    return ensure_tiny_qwen3_omni_assets(test_assets_root())


@pytest.fixture(scope="module")
def thinker_omni(assets):
    from vllm_omni import Omni

    overrides = {"0": {"dtype": "float32", "max_model_len": 256}}
    with Omni(str(assets.model_dir), pipeline="qwen3_omni_thinker_only", stage_overrides=overrides) as omni:
        yield omni


@torch.inference_mode()
def _reference(model_dir, clip) -> tuple[list[int], list[int], list[float]]:
    """transformers' thinker: prompt ids, greedy tokens and each token's logprob."""
    inputs = qwen3_omni_audio_inputs(model_dir, BEFORE, AFTER, clip)
    out = thinker(str(model_dir)).generate(
        **inputs,
        max_new_tokens=N,
        min_new_tokens=N,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens)]
    return inputs["input_ids"][0].tolist(), tokens, logprobs


def test_audio_prompt_equals_transformers_thinker(thinker_omni, assets):
    from vllm import SamplingParams

    clip = sine_noise_clip()
    ids, tokens, logprobs = _reference(assets.model_dir, clip)
    _, _, other_clip = _reference(assets.model_dir, sine_noise_clip(seed=1) * 0.1)
    assert max(abs(a - b) for a, b in zip(logprobs, other_clip)) > 1e-3  # the clip matters
    prompt = {
        "prompt": f"{BEFORE}<|audio_start|><|audio_pad|><|audio_end|>{AFTER}",
        "multi_modal_data": {"audio": (clip, 16000)},
    }
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=0)
    (out,) = thinker_omni.generate(prompt, params, use_tqdm=False)
    assert list(out.request_output.prompt_token_ids) == ids
    assert out.token_ids == tokens
    got = [step[t].logprob for step, t in zip(out.request_output.outputs[0].logprobs, tokens)]
    assert got == pytest.approx(logprobs, abs=1e-4)
