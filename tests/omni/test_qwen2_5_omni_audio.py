"""Qwen2.5-Omni end to end (thinker -> talker -> code2wav) against transformers' ``generate``.

One pipeline serves every test of the module; the transformers references are computed once
per session. Greedy thinker and talker on both sides, the DiT's starting noise seeded
identically (``torch.manual_seed(SEED)`` before transformers' ``generate``, ``AudioParams.seed``
here), few DiT steps.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from tools.make_tiny_qwen2_5_omni import SPEAKER, TALKER_EOS_TOKEN_IDS
from vllm_omni.inputs.audio import AudioParams
from vllm_omni.lora.request import LoRARequest
from vllm_omni.stages.qwen2_5_omni.code2wav import SAMPLE_RATE

THINK, TALK, STEPS, SEED = 6, 16, 3, 1234
PROMPTS = ((5, 6, 7, 8, 9, 10, 11, 12), (40, 41, 42, 43, 44))
LLM_OPTIONS = {"dtype": "float32", "max_model_len": 256, "enable_lora": True, "max_lora_rank": 16}


@functools.cache
def _hf_model(model_dir: str, thinker_adapter: str | None, talker_adapter: str | None):
    from peft import PeftModel
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    if thinker_adapter is not None:
        PeftModel.from_pretrained(model, thinker_adapter)  # injects the LoRA layers into ``model``
    if talker_adapter is not None:
        PeftModel.from_pretrained(model.talker, talker_adapter)  # into the talker sub-model
    return model


@functools.cache
def hf_reference(
    model_dir: str,
    prompt: tuple[int, ...],
    thinker_adapter: str | None = None,
    talker_adapter: str | None = None,
):
    """``(thinker tokens, talker codes, waveform)`` of transformers' ``generate(return_audio=True)``."""
    return _hf_generate(model_dir, {"input_ids": torch.tensor([prompt])}, thinker_adapter, talker_adapter)


def _hf_generate(model_dir: str, inputs: dict, thinker_adapter=None, talker_adapter=None):
    """``(thinker tokens, talker codes, waveform)`` of transformers' ``generate(return_audio=True)`` on
    full ``inputs`` (audio features when given), greedy thinker and talker, seeded DiT noise."""
    model = _hf_model(model_dir, thinker_adapter, talker_adapter)
    captured = {}
    talker_generate = model.talker.generate

    def capture(*args, **kwargs):
        out = talker_generate(*args, **kwargs)
        captured["codes"] = out[0, kwargs["input_ids"].shape[1] :].tolist()
        return out

    model.talker.generate = capture
    torch.manual_seed(SEED)
    try:
        seq, wav = model.generate(
            **inputs,
            speaker=SPEAKER,
            return_audio=True,
            thinker_max_new_tokens=THINK,
            thinker_do_sample=False,
            talker_max_new_tokens=TALK,
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
            talker_eos_token_id=list(TALKER_EOS_TOKEN_IDS),
            token2wav_num_steps=STEPS,
        )
    finally:
        del model.talker.generate
    codes = captured["codes"]
    stop = next((i for i, c in enumerate(codes) if c in TALKER_EOS_TOKEN_IDS), len(codes))
    return seq[0, inputs["input_ids"].shape[1] :].tolist(), codes[:stop], wav.numpy()


@pytest.fixture(scope="session")
def talker_adapter(tiny_omni_assets, tmp_path_factory):
    from tests.omni.talker_adapter import make_talker_adapter

    return make_talker_adapter(str(tiny_omni_assets.model_dir), tmp_path_factory.mktemp("talker") / "adapter")


@pytest.fixture(scope="module")
def omni(tiny_omni_assets):
    from vllm_omni import Omni

    overrides = {
        "0": LLM_OPTIONS | {"limit_mm_per_prompt": {"image": 0, "video": 0, "audio": 1}},
        "1": LLM_OPTIONS,
    }
    with Omni(str(tiny_omni_assets.model_dir), pipeline="qwen2_5_omni", stage_overrides=overrides) as engine:
        yield engine


def _params(voice=SPEAKER, seed=SEED):
    return [
        SamplingParams(temperature=0, max_tokens=THINK),
        SamplingParams(temperature=0, max_tokens=TALK),
        AudioParams(voice=voice, seed=seed, num_steps=STEPS),
    ]


def _run(omni, prompt, **kwargs):
    text, audio = omni.generate({"prompt_token_ids": list(prompt)}, _params(), **kwargs)
    return text, audio


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_codes_and_waveform_equal_transformers(omni, tiny_omni_assets, prompt):
    text, audio = _run(omni, prompt)
    tokens, codes, wav = hf_reference(str(tiny_omni_assets.model_dir), prompt)
    assert (text.stage_id, text.final_output_type, audio.stage_id, audio.final_output_type) == (
        0,
        "text",
        2,
        "audio",
    )
    assert text.token_ids == tokens
    assert audio.stage_outputs[1].codes.tolist() == codes and len(codes) > 0
    assert audio.sample_rate == SAMPLE_RATE and audio.audio.dtype == np.float32 and audio.audio.ndim == 1
    np.testing.assert_allclose(audio.audio, wav, rtol=0, atol=1e-5)
    assert np.abs(wav).max() > 1e-3  # not a silent reference


def test_the_stages_describe_text_codec_and_audio(omni, tiny_omni_assets):
    """What each stage says about itself: what the front end reads (output kinds, voices, params)."""
    voices = tuple(torch.load(Path(tiny_omni_assets.model_dir) / "spk_dict.pt", weights_only=True))
    thinker, talker, code2wav = omni._orchestrator.descriptions
    assert (thinker.output_kind, talker.output_kind, code2wav.output_kind) == ("text", "codec", "audio")
    assert thinker.inputs == {"text", "token_ids"} and code2wav.inputs == {"stage_payload"}
    assert talker.inputs == {"stage_payload", "media_payload"}  # speaks replies to prompts with audio
    assert thinker.params_type is talker.params_type is SamplingParams and code2wav.params_type is AudioParams
    assert talker.voices == code2wav.voices == voices and SPEAKER in voices
    assert thinker.max_model_len == talker.max_model_len == 256
    assert thinker.adapters.kind == talker.adapters.kind == "llm" and code2wav.adapters is None
    info = omni.entry_stage_info
    assert info.output_kinds == {"text", "audio"} and info.voices == voices
    assert info.stage_is_audio == (False, False, True)


def test_waveform_depends_on_codes_voice_and_seed(omni):
    """The comparison above is meaningful: other codes, voices or noise give other waveforms."""
    base = _run(omni, PROMPTS[0])[1].audio
    other_prompt = _run(omni, PROMPTS[1])[1].audio
    other_voice = omni.generate({"prompt_token_ids": list(PROMPTS[0])}, _params(voice="Ethan"))[1].audio
    other_seed = omni.generate({"prompt_token_ids": list(PROMPTS[0])}, _params(seed=SEED + 1))[1].audio
    for other in (other_voice, other_seed):
        assert other.shape == base.shape and np.abs(other - base).max() > 1e-4
    assert other_prompt.shape != base.shape or np.abs(other_prompt - base).max() > 1e-4


def test_thinker_adapter_reaches_the_thinker_and_its_hidden_states(omni, tiny_omni_assets):
    """The entry adapter changes the thinker's tokens and the hidden states the talker reads
    (the thinker's own pass, with the adapter): equal to peft on transformers' thinker."""
    adapter = LoRARequest("thinker", 1, str(tiny_omni_assets.thinker_adapter))
    text, audio = _run(omni, PROMPTS[0], lora_request=adapter)
    tokens, codes, wav = hf_reference(
        str(tiny_omni_assets.model_dir), PROMPTS[0], str(tiny_omni_assets.thinker_adapter)
    )
    assert tokens != hf_reference(str(tiny_omni_assets.model_dir), PROMPTS[0])[0]
    assert text.token_ids == tokens
    assert audio.stage_outputs[1].codes.tolist() == codes
    np.testing.assert_allclose(audio.audio, wav, rtol=0, atol=1e-5)


def test_unknown_voice_is_refused(omni):
    from vllm_omni.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="unknown voice 'nobody'"):
        omni.generate({"prompt_token_ids": list(PROMPTS[0])}, _params(voice="nobody"))


def test_per_stage_adapters_reach_thinker_and_talker(omni, tiny_omni_assets, talker_adapter):
    """``lora_request={0: thinker, 1: talker}``: each adapter reaches its stage (the thinker's also
    its hidden states); tokens, codes and waveform equal transformers with peft on both sub-models."""
    thinker = LoRARequest("thinker", 1, str(tiny_omni_assets.thinker_adapter))
    talker = LoRARequest("talker", 2, str(talker_adapter))
    model_dir = str(tiny_omni_assets.model_dir)
    text, audio = _run(omni, PROMPTS[0], lora_request={0: thinker, 1: talker})
    tokens, codes, wav = hf_reference(
        model_dir, PROMPTS[0], str(tiny_omni_assets.thinker_adapter), str(talker_adapter)
    )
    assert text.token_ids == tokens
    assert audio.stage_outputs[1].codes.tolist() == codes
    np.testing.assert_allclose(audio.audio, wav, rtol=0, atol=1e-5)
    # the talker adapter alone changes the codes, not the text
    text_t, audio_t = _run(omni, PROMPTS[0], lora_request={1: talker})
    base_tokens, base_codes, _ = hf_reference(model_dir, PROMPTS[0])
    _, talker_codes, _ = hf_reference(model_dir, PROMPTS[0], None, str(talker_adapter))
    assert text_t.token_ids == base_tokens
    assert audio_t.stage_outputs[1].codes.tolist() == talker_codes != base_codes


def test_an_adapter_for_code2wav_is_refused_naming_the_stage(omni, talker_adapter):
    from vllm_omni.errors import LoRANotEnabledError

    with pytest.raises(LoRANotEnabledError, match=r"Stage 2 \(llm_generation\)"):
        _run(omni, PROMPTS[0], lora_request={2: LoRARequest("talker", 2, str(talker_adapter))})


def test_last_stage_returns_text_without_running_the_audio_stages(omni, monkeypatch):
    talker = omni._orchestrator.runtimes[1]
    monkeypatch.setattr(talker, "submit", lambda *a, **k: pytest.fail("the talker ran"))
    outs = omni.generate({"prompt_token_ids": list(PROMPTS[0])}, _params(), last_stage=0)
    assert [o.final_output_type for o in outs] == ["text"] and outs[0].token_ids


def test_audio_prompt_is_spoken_like_transformers(omni, tiny_omni_assets):
    """A prompt with audio runs all three stages: the talker reads the thinker's hidden states of
    the audio positions from the thinker's own pass. Tokens, codes and waveform equal transformers'
    ``generate(return_audio=True)`` on the same Whisper features (the prompt ids too)."""
    from omni_reference import qwen2_5_omni_audio_inputs, sine_noise_clip

    model_dir = str(tiny_omni_assets.model_dir)
    clip = sine_noise_clip()
    prompt = {
        "prompt": "Listen:<|audio_bos|><|AUDIO|><|audio_eos|> now",
        "multi_modal_data": {"audio": (clip, 16000)},
    }
    text, audio = omni.generate(prompt, _params())
    inputs = qwen2_5_omni_audio_inputs(model_dir, "Listen:", " now", clip)
    assert text.stage_outputs[0].prompt_token_ids == inputs["input_ids"][0].tolist()
    tokens, codes, wav = _hf_generate(model_dir, inputs)
    assert text.token_ids == tokens
    assert audio.stage_outputs[1].codes.tolist() == codes and len(codes) > 0
    np.testing.assert_allclose(audio.audio, wav, rtol=0, atol=1e-5)


def test_thinker_returns_its_hidden_states_and_the_talker_one_request_per_reply(omni, tiny_omni_assets):
    """The hand-off's hidden states are the thinker stage's own (== transformers' thinker
    ``hidden_states[-1]`` over prompt + reply[:-1]); two replies decoded side by side in the talker's
    engine (one batch, a stream each) equal their references, and each reply is one engine request."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model_dir = str(tiny_omni_assets.model_dir)
    talker = omni._orchestrator.runtimes[1]
    before = talker.stats().requests
    outs = omni.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], _params())
    assert talker.stats().requests - before == 2
    for prompt, (text, audio) in zip(PROMPTS, (outs[0:2], outs[2:4]), strict=True):
        tokens, codes, wav = hf_reference(model_dir, prompt)
        assert (text.token_ids, audio.stage_outputs[1].codes.tolist()) == (tokens, codes), prompt
        np.testing.assert_allclose(audio.audio, wav, rtol=0, atol=1e-5)
    first = outs[0].stage_outputs[0]
    hidden = first.omni_hidden_states
    seq = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)[:-1]
    assert hidden.dtype == torch.float32 and hidden.shape[0] == len(seq)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model.thinker(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(hidden, ref, rtol=0, atol=1e-4)
    assert not hasattr(talker, "states")  # no second thinker in the talker


def test_a_talker_payload_without_hidden_states_is_refused_naming_the_stage(omni):
    from vllm_omni.engine.connectors import StagePayload
    from vllm_omni.errors import StageEngineError
    from vllm_omni.inputs.stage_request import StageRequest

    payload = StagePayload(
        {"prompt_token_ids": torch.tensor(PROMPTS[0]), "output_token_ids": torch.tensor([5, 6])}, {}
    )
    talker = omni._orchestrator.runtimes[1]
    with pytest.raises(
        StageEngineError, match=r"Stage 1 \(llm_ar\): the thinker's payload has no hidden_states"
    ):
        talker.submit(StageRequest(payload, SamplingParams(temperature=0, max_tokens=4)))
    assert _run(omni, PROMPTS[0])[1].stage_outputs[1].codes.numel() > 0  # the stage keeps serving


def _hf_codes(model_dir: str, prompt, **talker_kwargs) -> list[int]:
    """transformers' talker codes (before the stop token) with extra ``talker_*`` arguments."""
    model = _hf_model(model_dir, None, None)
    captured = {}
    talker_generate = model.talker.generate

    def capture(*args, **kwargs):
        out = talker_generate(*args, **kwargs)
        captured["codes"] = out[0, kwargs["input_ids"].shape[1] :].tolist()
        return out

    model.talker.generate = capture
    try:
        model.generate(
            input_ids=torch.tensor([prompt]),
            speaker=SPEAKER,
            return_audio=True,
            thinker_max_new_tokens=THINK,
            thinker_do_sample=False,
            talker_max_new_tokens=TALK,
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
            talker_eos_token_id=list(TALKER_EOS_TOKEN_IDS),
            token2wav_num_steps=1,
            **talker_kwargs,
        )
    finally:
        del model.talker.generate
    codes = captured["codes"]
    return codes[: next((i for i, c in enumerate(codes) if c in TALKER_EOS_TOKEN_IDS), len(codes))]


def test_one_sampling_params_is_the_thinkers_and_never_reaches_talker_steps(omni, tiny_omni_assets):
    """Issue 21 rule 8: one ``SamplingParams`` on the three-stage pipeline describes the thinker's
    text; the talker keeps its own defaults (with the request's seed), so ``min_tokens=12`` no longer
    reaches the talker's one-token steps (it died there with vLLM's ``min_tokens must be less than or
    equal to max_tokens=1``). The result equals the explicit per-stage list that rule spells out, and
    the thinker's tokens equal transformers' greedy thinker with ``min_new_tokens=12``."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from vllm_omni.stages.qwen2_5_omni.pipeline import default_talker_params

    prompt = {"prompt_token_ids": list(PROMPTS[1])}
    one = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, seed=SEED)
    text, audio = omni.generate(prompt, one)
    assert len(text.token_ids) == 12
    talker = default_talker_params().clone()
    talker.seed = SEED
    text2, audio2 = omni.generate(prompt, [one, talker, AudioParams(seed=SEED)])
    assert text.token_ids == text2.token_ids
    assert audio.stage_outputs[1].codes.tolist() == audio2.stage_outputs[1].codes.tolist()
    np.testing.assert_array_equal(audio.audio, audio2.audio)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(
        str(tiny_omni_assets.model_dir), dtype=torch.float32
    ).eval()
    ids = torch.tensor([PROMPTS[1]])
    ref = model.thinker.generate(input_ids=ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert text.token_ids == ref[0, ids.shape[1] :].tolist()


def test_talker_min_tokens_holds_back_its_stop_tokens_like_transformers(omni, tiny_omni_assets):
    """A talker entry of a per-stage list acts on the codec sequence: ``min_tokens`` = transformers'
    ``talker_min_new_tokens`` (no stop token before that many codes), never on one step."""
    model_dir = str(tiny_omni_assets.model_dir)
    prompt = (1, 2, 3)  # greedy codes stop after one code on the tiny checkpoint
    base = _hf_codes(model_dir, prompt)
    need = len(base) + 3
    assert need <= TALK  # the reference stops early, so min_tokens changes the codes
    want = _hf_codes(model_dir, prompt, talker_min_new_tokens=need)
    params = _params()
    params[1] = SamplingParams(temperature=0, max_tokens=TALK, min_tokens=need)
    _, audio = omni.generate({"prompt_token_ids": list(prompt)}, params)
    got = audio.stage_outputs[1].codes.tolist()
    assert got == want and len(got) >= need and got[: len(base)] == base


def test_talker_refuses_fields_it_cannot_apply(omni):
    from vllm_omni.errors import InvalidRequestError

    params = _params()
    params[1] = SamplingParams(temperature=0, max_tokens=TALK, stop=["."])
    with pytest.raises(InvalidRequestError, match=r"Stage 1 \(llm_ar\).*cannot apply \['stop'\]"):
        omni.generate({"prompt_token_ids": list(PROMPTS[0])}, params)


def test_several_thinker_completions_are_text_only(omni):
    """The talker speaks one completion: ``n=2`` on the thinker with speech asked is refused naming
    ``n`` and the way out; text only (``last_stage=0``) answers it with two completions."""
    from vllm_omni.errors import InvalidRequestError

    params = _params()
    params[0] = SamplingParams(temperature=0.5, max_tokens=THINK, n=2, seed=1)
    prompt = {"prompt_token_ids": list(PROMPTS[0])}
    with pytest.raises(
        InvalidRequestError,
        match=r"Stage 1 \(llm_ar\): the talker speaks one completion.*asked for 2.*last_stage=0",
    ):
        omni.generate(prompt, params)
    (text,) = omni.generate(prompt, params, last_stage=0)
    assert len(text.request_output.outputs) == 2
    assert getattr(text.request_output, "omni_hidden_states", None) is None


@pytest.mark.parametrize(
    ("stage", "params", "match"),
    [
        (
            0,
            SamplingParams(max_tokens=THINK, n=2, extra_args={"vllm_omni_step_io": ["x"]}),
            r"Stage 0 .*reserved",
        ),
        (
            0,
            SamplingParams(max_tokens=THINK, extra_args=["x"]),
            r"Stage 0 .*extra_args must be a dict, got list",
        ),
        (
            1,
            SamplingParams(max_tokens=TALK, extra_args=["x"]),
            r"Stage 1 .*cannot apply \['extra_args'\]",
        ),
        (
            1,
            SamplingParams(max_tokens=1000, min_tokens=400),
            r"Stage 1 .*min_tokens 400 exceeds the \d+ codes left",
        ),
        (
            1,
            SamplingParams(max_tokens=TALK, stop_token_ids=[10**6]),
            r"Stage 1 .*stop_token_ids \[1000000\] are not",
        ),
        (
            1,
            SamplingParams(max_tokens=TALK, logit_bias={10**6: 1.0}),
            r"Stage 1 .*logit_bias \[1000000\] are not",
        ),
    ],
)
def test_bad_params_fail_their_request_naming_stage_and_field_and_the_pipeline_keeps_serving(
    omni, tiny_omni_assets, stage, params, match
):
    """Regression (a breaker's findings): an ``extra_args`` value the step table cannot key on killed the
    thinker's engine at its next step, for every later request; talker fields vLLM would refuse with its
    own unnamed message are refused naming the stage and the field. Afterwards the pipeline answers."""
    from vllm_omni.errors import InvalidRequestError

    run = _params()
    run[stage] = params
    with pytest.raises(InvalidRequestError, match=match):
        omni.generate({"prompt_token_ids": list(PROMPTS[0])}, run, last_stage=None if stage else 0)
    text, audio = _run(omni, PROMPTS[0])
    assert (text.token_ids, audio.stage_outputs[1].codes.tolist()) == hf_reference(
        str(tiny_omni_assets.model_dir), PROMPTS[0]
    )[:2]


def test_a_reply_without_codes_is_an_empty_waveform(omni):
    """The talker's first greedy sample can be a stop code (this prompt on the tiny checkpoint): code2wav
    returns an empty waveform, as Qwen3-Omni's does (transformers' Token2Wav fails on no codes)."""
    text, audio = _run(omni, (5, 6, 7, 8))
    assert text.token_ids and audio.stage_outputs[1].codes.numel() == 0
    assert audio.audio.shape == (0,) and audio.audio.dtype == np.float32
