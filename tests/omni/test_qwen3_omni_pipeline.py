"""Qwen3-Omni on one pipeline (tiny checkpoint, float32): ``Omni(<folder>)`` picks ``qwen3_omni``
(MoE thinker on vLLM with LoRA -> talker -> code2wav on transformers).

- The thinker (``last_stage=0``): greedy tokens equal transformers' ``Qwen3OmniMoeForConditionalGeneration``
  thinker with and without a thinker adapter (peft); ``enable_lora`` runs on CPU because the MoE experts
  stay out of LoRA (:func:`vllm_omni.models.moe_lora.keep_moe_experts_out_of_lora`), and an adapter on
  expert weights is refused before it reaches vLLM, which would load it and silently not apply it.
- The whole pipeline: text, codes and waveform against transformers' ``generate(return_audio=True)``
  (run once), greedy thinker and talker on both sides (transformers mirrors the talker's ``do_sample``
  onto its code predictor), the thinker's stop at ``<|im_end|>`` on both sides.
- The talker with LoRA (``enable_lora`` on stage 1): a talker adapter (attention, shared expert, code
  predictor) gives the codes of transformers' ``generate`` with peft on ``model.talker``; with a thinker
  adapter on the same request each reaches its stage; expert and wrong-model adapters are refused
  before the request starts, naming the adapter and key, and the stage keeps serving.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from omni_reference import thinker_greedy
from vllm import SamplingParams

from tests.conftest import test_assets_root
from vllm_omni.errors import ConfigError, InvalidAdapterError, InvalidRequestError, LoRANotEnabledError
from vllm_omni.inputs.audio import AudioParams
from vllm_omni.lora.request import LoRARequest

THINK, TALK = 8, 16
TEXT = "Once upon a time"
PROMPTS = [TEXT, "The weather today is"]
N = THINK
THINKER_ARCH = "OmniQwen3OmniMoeThinkerForConditionalGeneration"
#: the waveform's tolerance against transformers (float32, same code path). Measured max |ours -
#: transformers|: 0.0 here, in test_qwen3_omni_workers.py (code2wav in its own process) and across
#: 1-16 CPU threads; the tiny code2wav's float32 output differs from its float64 one by ~3e-6 (waveform
#: std ~0.1), so 1e-5 is a few times the rounding noise of a reordered sum, and ~1e-4 of the std.
WAVE_ATOL = 1e-5
#: a sample this close to transformers' clamp of the waveform to [-1, 1] counts as saturated
SATURATED = 0.999


def assert_audible(wav) -> None:
    """The reference waveform is worth comparing: under 1% of its samples at the clamp (+-1), where
    any two waveforms of the same signs agree, and not silent (the tiny checkpoint scales its
    code2wav's output layer for this: ``CODE2WAV_OUTPUT_SCALE`` in tools/make_tiny_qwen3_omni.py)."""
    wav = np.asarray(wav, dtype=np.float64)
    saturated = float(np.mean(np.abs(wav) >= SATURATED))
    assert saturated < 0.01, f"{saturated:.1%} of the reference's samples are at the clamp (+-1)"
    assert wav.std() > 1e-3, f"a silent reference (std {wav.std():.2e})"


@pytest.fixture(scope="module")
def assets():
    from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets

    return ensure_tiny_qwen3_omni_assets(test_assets_root())


@pytest.fixture(scope="module")
def omni(assets):
    from vllm_omni import Omni

    # peft writes rank_pattern {".*\\.gate_up_proj": 2r} into every adapter of this model, and
    # vLLM checks that rank against max_lora_rank: 16 for the rank-8 adapters here
    stage = {"dtype": "float32", "max_model_len": 256, "enable_lora": True, "max_lora_rank": 16}
    talker = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    with Omni(str(assets.model_dir), stage_overrides={"0": stage, "1": talker}) as engine:
        yield engine


def _chat(omni, text=TEXT) -> str:
    tokenizer = omni._orchestrator.runtimes[0].tokenizer
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def _text_params():
    """The thinker's, for ``last_stage=0`` runs: ``N`` tokens, no stop."""
    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def _prompt_ids(omni, text):
    return omni._orchestrator.runtimes[0].tokenizer.encode(text, add_special_tokens=False)


def _params(voice="Ethan"):
    return [
        SamplingParams(temperature=0, max_tokens=THINK),
        SamplingParams(temperature=0, max_tokens=TALK),
        AudioParams(voice=voice),
    ]


@functools.cache
def reference(
    model_dir: str,
    prompt_ids: tuple[int, ...],
    eos: int,
    voice: str,
    thinker_adapter: str | None = None,
    talker_adapter: str | None = None,
):
    """``(thinker tokens, talker codes [G, N], waveform)`` of transformers' Omni ``generate``, with
    peft's adapters on the whole model (thinker) and on ``model.talker`` (talker) when given."""
    from peft import PeftModel
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    if thinker_adapter is not None:
        PeftModel.from_pretrained(model, thinker_adapter)  # injects the LoRA layers into ``model``
    if talker_adapter is not None:
        PeftModel.from_pretrained(model.talker, talker_adapter)  # into the talker sub-model
    ids = torch.tensor([prompt_ids])
    return _omni_generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, voice, eos)


def _omni_generate(model, inputs: dict, voice: str, eos):
    """``(thinker tokens, talker codes [G, N], waveform)`` of ``model.generate`` on ``inputs``: the thinker
    stops at ``eos``, the talker greedy for ``TALK`` steps (codes captured at code2wav's input)."""
    captured = {}
    decode = model.code2wav.chunked_decode

    def capture(codes, **kwargs):
        captured["codes"] = codes[0].clone()
        return decode(codes, **kwargs)

    model.code2wav.chunked_decode = capture
    try:
        seq, wav = model.generate(
            **inputs,
            speaker=voice,
            thinker_max_new_tokens=THINK,
            thinker_eos_token_id=eos,
            talker_do_sample=False,
            talker_max_new_tokens=TALK,
            talker_repetition_penalty=1.0,  # what _params() asks of the talker (transformers' default: 1.05)
        )
    finally:
        del model.code2wav.chunked_decode
    return seq[0, inputs["input_ids"].shape[1] :].tolist(), captured["codes"], wav.reshape(-1).numpy()


def test_thinker_runs_vllms_moe_thinker_with_experts_out_of_lora(omni):
    """Without torchvision (this venv) the stage runs a same-named subclass of vLLM's class that loads
    without the video processor (:mod:`vllm_omni.models.thinker_without_torchvision`): audio (one clip by
    default on CPU), no image or video, as Qwen2.5-Omni's thinker."""
    from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3OmniMoeThinkerForConditionalGeneration

    from vllm_omni.models import qwen3_omni_thinker
    from vllm_omni.models.moe_lora import moe_experts_kept_out_of_lora

    assert omni.stage_configs[0].model_arch == THINKER_ARCH
    assert issubclass(
        qwen3_omni_thinker.Qwen3OmniMoeThinkerForConditionalGeneration,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )
    assert moe_experts_kept_out_of_lora()
    mm = omni._orchestrator.runtimes[0]._engine.vllm_config.model_config.multimodal_config
    assert [mm.get_limit_per_prompt(m) for m in ("audio", "image", "video")] == [1, 0, 0]


def test_thinker_tokens_equal_transformers_with_and_without_adapter(omni, assets):
    adapter = LoRARequest("thinker", 1, str(assets.thinker_adapter))
    base = omni.generate(PROMPTS, _text_params(), last_stage=0, use_tqdm=False)
    adapted = omni.generate(PROMPTS, _text_params(), lora_request={0: adapter}, last_stage=0, use_tqdm=False)
    for prompt, plain, out in zip(PROMPTS, base, adapted):
        ids = _prompt_ids(omni, prompt)
        assert plain.token_ids == thinker_greedy(assets.model_dir, ids, N)
        assert out.token_ids == thinker_greedy(assets.model_dir, ids, N, assets.thinker_adapter)
        assert out.token_ids != plain.token_ids  # the adapter does change the output


def _per_expert_adapter(path, layer0_experts=2):
    """An adapter in the per-expert layout (``mlp.experts.{e}.gate_proj``, as vLLM's 2-D MoE LoRA
    reads it) on the thinker's layer-0 experts, plus a valid ``q_proj``."""
    import torch
    from safetensors.torch import save_file

    from tools.make_tiny_qwen3_omni import HIDDEN

    prefix = "base_model.model.thinker.model.layers.0."
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN)}
    shapes |= {f"mlp.experts.{e}.gate_proj": (HIDDEN, 64) for e in range(layer0_experts)}
    tensors = {}
    for module, (d_in, d_out) in shapes.items():
        tensors[f"{prefix}{module}.lora_A.weight"] = torch.full((8, d_in), 0.01)
        tensors[f"{prefix}{module}.lora_B.weight"] = torch.full((d_out, 8), 0.01)
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "gate_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("layout", ["peft", "per_expert"])
def test_adapter_on_moe_experts_is_refused_with_the_reason(omni, assets, tmp_path, layout):
    """peft 0.21 turns the MLP names into the fused experts of every MoE block (target_parameters);
    an adapter in the per-expert layout names them as modules. vLLM on CPU keeps experts out of
    LoRA and would serve the base model for them: both are refused, saying why, and the stage
    keeps serving."""
    path = assets.experts_adapter if layout == "peft" else _per_expert_adapter(tmp_path / "experts")
    with pytest.raises(InvalidAdapterError) as err:
        omni.generate(
            PROMPTS[0],
            _text_params(),
            lora_request={0: LoRARequest("experts", 2 if layout == "peft" else 3, str(path))},
            last_stage=0,
            use_tqdm=False,
        )
    message = str(err.value)
    assert "'experts'" in message
    assert "keeps MoE experts out of LoRA" in message and "Triton" in message
    if layout == "per_expert":
        assert "Stage 0 (llm_ar)" in message
        assert "thinker.model.layers.0.mlp.experts.0.gate_proj" in message
    else:
        assert "target_parameters" in message
    (out,) = omni.generate(PROMPTS[0], _text_params(), last_stage=0, use_tqdm=False)
    assert out.token_ids == thinker_greedy(assets.model_dir, _prompt_ids(omni, PROMPTS[0]), N)


def test_folder_gets_thinker_talker_and_code2wav(omni):
    assert omni.config.pipeline.name == "qwen3_omni"
    assert [s.model_arch for s in omni.stage_configs] == [
        "OmniQwen3OmniMoeThinkerForConditionalGeneration",
        "OmniQwen3OmniMoeTalkerForConditionalGeneration",
        "OmniQwen3OmniMoeCode2Wav",
    ]
    kinds = [d.output_kind for d in omni._orchestrator.descriptions]
    assert kinds == ["text", "codec", "audio"]


def test_text_codes_and_waveform_equal_transformers(omni, assets):
    from vllm_omni.stages.qwen3_omni.code2wav import SAMPLE_RATE

    prompt = _chat(omni)
    text, audio = omni.generate(prompt, _params(), use_tqdm=False)
    tokenizer = omni._orchestrator.runtimes[0].tokenizer
    ids = tuple(tokenizer.encode(prompt, add_special_tokens=False))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens, codes, wav = reference(str(assets.model_dir), ids, eos, "Ethan")
    assert text.token_ids == tokens
    talker_codes = audio.stage_outputs[1].codes
    assert talker_codes.shape == codes.shape and talker_codes.shape[1] > 0
    assert torch.equal(talker_codes, codes)
    assert audio.sample_rate == SAMPLE_RATE and audio.audio.dtype == np.float32 and audio.audio.ndim == 1
    assert_audible(wav)
    np.testing.assert_allclose(audio.audio, wav, rtol=0, atol=WAVE_ATOL)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lora_request": {2: "talker"}}, LoRANotEnabledError, r"Stage 2 \(llm_generation\)"),
        ({"voice": "nobody"}, InvalidRequestError, "unknown voice 'nobody'"),
        ({"prompt": TEXT}, InvalidRequestError, r"Stage 1 .*no '<\|im_start\|>assistant' turn"),
    ],
)
def test_bad_requests_are_refused_naming_the_stage(omni, assets, kwargs, error, match):
    """An adapter for a stage without LoRA (code2wav) or an unknown voice is refused before the
    request starts; a prompt without the chat template's assistant turn is refused by the talker.
    The pipeline keeps serving."""
    lora = kwargs.get("lora_request")
    if lora is not None:
        lora = {stage: LoRARequest(name, 7, str(assets.thinker_adapter)) for stage, name in lora.items()}
    prompt = kwargs.get("prompt", _chat(omni))
    with pytest.raises(error, match=match):
        omni.generate(prompt, _params(kwargs.get("voice", "Ethan")), lora_request=lora, use_tqdm=False)
    text, audio = omni.generate(_chat(omni), _params(), use_tqdm=False)
    assert len(text.token_ids) == THINK and audio.audio.size > 0


@pytest.mark.parametrize(
    ("media", "match"),
    [
        (
            "<|audio_start|><|audio_pad|><|audio_end|>",
            r"audio placeholders and the thinker stage returned no",
        ),
        ("<|vision_start|><|image_pad|><|vision_end|>", r"image/video placeholders; .*last_stage=0"),
    ],
)
def test_talker_refuses_media_it_cannot_speak(omni, media, match):
    """Audio placeholders need the thinker's capture-layer hidden states in the payload; image/video
    placeholders are refused (not checked against transformers), naming the stage."""
    from vllm_omni.engine.connectors import StagePayload
    from vllm_omni.inputs.stage_request import StageRequest

    talker = omni._orchestrator.runtimes[1]
    prompt = omni._orchestrator.runtimes[0].tokenizer.encode(
        _chat(omni, media + "hi"), add_special_tokens=False
    )
    payload = StagePayload(
        {"prompt_token_ids": torch.tensor(prompt), "output_token_ids": torch.tensor([5, 6])}, {}
    )
    with pytest.raises(InvalidRequestError, match=r"Stage 1 \(llm_ar\): the prompt holds " + match):
        talker.validate_request(StageRequest(payload, None))


def test_audio_prompt_is_spoken_like_transformers(omni, assets):
    """A chat prompt with audio runs all three stages: the thinker stage returns its hidden states after
    the talker's ``accept_hidden_layer`` layers for the audio positions (its own pass), and the talker's
    rows there are their ``hidden_projection``. Tokens, codes and waveform equal transformers' Omni
    ``generate(return_audio=True)`` on the same Whisper features."""
    from omni_reference import qwen3_omni_audio_inputs, sine_noise_clip

    assert "media_payload" in omni._orchestrator.descriptions[1].inputs
    clip = sine_noise_clip()
    chat = _chat(omni, "<|audio_start|><|audio_pad|><|audio_end|>" + TEXT)
    before, after = chat.split("<|audio_start|><|audio_pad|><|audio_end|>")
    text, audio = omni.generate({"prompt": chat, "multi_modal_data": {"audio": (clip, 16000)}}, _params())
    inputs = qwen3_omni_audio_inputs(str(assets.model_dir), before, after, clip)
    assert text.stage_outputs[0].prompt_token_ids == inputs["input_ids"][0].tolist()
    tokens, codes, wav = _reference_with(str(assets.model_dir), inputs)
    assert text.token_ids == tokens
    assert torch.equal(audio.stage_outputs[1].codes, codes) and codes.shape[1] > 0
    assert_audible(wav)
    np.testing.assert_allclose(audio.audio, wav, rtol=0, atol=WAVE_ATOL)
    # the audio rows matter: the same payload with those hidden states zeroed gives other codes
    from vllm_omni.inputs.stage_request import StageRequest
    from vllm_omni.stages.qwen2_5_omni.pipeline import thinker2talker

    payload = thinker2talker(text.stage_outputs[0], _params(), None)
    assert payload.tensors["layer_hidden_states"].shape[0] == len(inputs["input_ids"][0]) + len(tokens) - 1
    payload.tensors["layer_hidden_states"] = torch.zeros_like(payload.tensors["layer_hidden_states"])
    other = omni._orchestrator.runtimes[1].submit(StageRequest(payload, _params()[1])).result().codes
    assert not torch.equal(other, codes)


def _reference_with(model_dir: str, inputs: dict):
    """:func:`reference` on full ``inputs`` (audio features included); the thinker stops at the checkpoint's
    ``generation_config`` eos ids, as vLLM's does."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _omni_generate(model, inputs, "Ethan", model.generation_config.eos_token_id)


def test_global_lora_options_are_refused_naming_the_llm_stages(assets):
    from vllm_omni.entrypoints.omni_base import build_omni_config

    with pytest.raises(ConfigError, match=r"qwen3_omni.*\[0, 1, 2\]"):
        build_omni_config(str(assets.model_dir), enable_lora=True)


# ---------------------------------------------------------------------------- talker LoRA


def _run_audio(omni, lora=None):
    """``(text ids, talker codes, waveform)`` of the chat prompt through the whole pipeline."""
    text, audio = omni.generate(_chat(omni), _params(), lora_request=lora, use_tqdm=False)
    return text.token_ids, audio.stage_outputs[1].codes, audio.audio


def _reference(omni, assets, thinker=None, talker=None):
    tokenizer = omni._orchestrator.runtimes[0].tokenizer
    ids = tuple(tokenizer.encode(_chat(omni), add_special_tokens=False))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    adapters = [None if a is None else str(a) for a in (thinker, talker)]
    return reference(str(assets.model_dir), ids, eos, "Ethan", *adapters)


def test_talker_adapter_codes_equal_peft_on_transformers_talker(omni, assets):
    """``lora_request={1: adapter}``: the talker's codes (greedy, float32; attention, shared-expert MLP
    and code-predictor layers adapted) equal transformers' ``generate`` with peft on ``model.talker``,
    differ from the base codes, and the waveform follows (code2wav: same tolerance as without LoRA);
    the thinker's text is untouched."""
    description = omni._orchestrator.descriptions[1]
    assert (description.adapters.kind, description.adapters.max_lora_rank) == ("llm", 8)
    talker = LoRARequest("talker", 11, str(assets.talker_adapter))
    tokens, codes, wav = _run_audio(omni, {1: talker})
    base_tokens, base_codes, _ = _reference(omni, assets)
    ref_tokens, ref_codes, ref_wav = _reference(omni, assets, talker=assets.talker_adapter)
    assert tokens == ref_tokens == base_tokens
    assert codes.shape == ref_codes.shape and torch.equal(codes, ref_codes)
    assert codes.shape != base_codes.shape or not torch.equal(codes, base_codes)  # the adapter acts
    assert_audible(ref_wav)
    np.testing.assert_allclose(wav, ref_wav, rtol=0, atol=WAVE_ATOL)


def test_thinker_and_talker_adapters_on_one_request_each_reach_their_stage(omni, assets):
    """``{0: thinker adapter, 1: talker adapter}``: text equals transformers with peft's thinker
    adapter, codes equal transformers with both adapters (the talker reads the adapted reply)."""
    lora = {
        0: LoRARequest("thinker", 1, str(assets.thinker_adapter)),
        1: LoRARequest("talker", 11, str(assets.talker_adapter)),
    }
    tokens, codes, wav = _run_audio(omni, lora)
    ref_tokens, ref_codes, ref_wav = _reference(omni, assets, assets.thinker_adapter, assets.talker_adapter)
    assert tokens == ref_tokens != _reference(omni, assets)[0]
    assert torch.equal(codes, ref_codes)
    thinker_only = _reference(omni, assets, thinker=assets.thinker_adapter)[1]
    assert codes.shape != thinker_only.shape or not torch.equal(codes, thinker_only)
    assert_audible(ref_wav)
    np.testing.assert_allclose(wav, ref_wav, rtol=0, atol=WAVE_ATOL)


def _whole_model_adapter(assets, path):
    """The talker adapter as peft saves it from the whole Omni model (keys ``base_model.model.talker.``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path.mkdir()
    shutil.copy(assets.talker_adapter / "adapter_config.json", path)
    tensors = load_file(assets.talker_adapter / "adapter_model.safetensors")
    prefix = "base_model.model."
    save_file(
        {prefix + "talker." + k[len(prefix) :]: v for k, v in tensors.items()},
        path / "adapter_model.safetensors",
    )
    return path


def test_talker_adapter_saved_from_the_whole_model_gives_the_same_codes(omni, assets, tmp_path):
    lora = LoRARequest("talker_full", 12, str(_whole_model_adapter(assets, tmp_path / "full")))
    codes = _run_audio(omni, {1: lora})[1]
    assert torch.equal(codes, _reference(omni, assets, talker=assets.talker_adapter)[1])


@pytest.mark.parametrize("which", ["experts", "thinker"])
def test_talker_refuses_expert_and_wrong_model_adapters_and_keeps_serving(omni, assets, which):
    """An adapter on the fused experts (peft ``target_parameters``) or one for another model (the
    thinker's) is refused before the request starts, naming the adapter, file and key; the talker
    adapter used before still gives the reference codes, and the base model the base codes."""
    path = assets.talker_experts_adapter if which == "experts" else assets.thinker_adapter
    lora = LoRARequest(f"bad_{which}", {"experts": 21, "thinker": 22}[which], str(path))
    with pytest.raises(InvalidAdapterError) as err:
        _run_audio(omni, {1: lora})
    message = str(err.value)
    assert f"'bad_{which}'" in message and "Stage 1 (llm_ar)" in message and str(path) in message
    if which == "experts":
        assert "'base_model.model.model.layers.0.mlp.experts.lora_A.weight'" in message
        assert "fused parameters" in message and "not linear layers" in message
    else:
        assert "'thinker.model.layers.0.self_attn.q_proj'" in message and "bind no LoRA layer" in message
    assert lora.lora_int_id not in omni._orchestrator.runtimes[1].list_loras()
    talker = LoRARequest("talker", 11, str(assets.talker_adapter))
    assert torch.equal(
        _run_audio(omni, {1: talker})[1], _reference(omni, assets, talker=assets.talker_adapter)[1]
    )
    assert torch.equal(_run_audio(omni)[1], _reference(omni, assets)[1])


def test_talker_adapters_are_managed_through_the_registry(omni, assets):
    """``add_lora(..., stage_id=1)`` loads on the talker (its host cache), ``pin`` / ``remove`` act there;
    an expert adapter is refused at registration and leaves nothing behind."""
    talker = omni._orchestrator.runtimes[1]
    with pytest.raises(InvalidAdapterError, match=r"'reg_experts'.*fused parameters"):
        omni.add_lora(LoRARequest("reg_experts", 31, str(assets.talker_experts_adapter)), stage_id=1)
    assert 31 not in omni.list_loras(stage_id=1) and 31 not in talker.list_loras()
    assert omni.add_lora(LoRARequest("reg_talker", 32, str(assets.talker_adapter)), stage_id=1)
    assert 32 in omni.list_loras(stage_id=1) and omni.pin_lora(32, stage_id=1)
    codes = _run_audio(omni, {1: LoRARequest("reg_talker", 32, str(assets.talker_adapter))})[1]
    assert torch.equal(codes, _reference(omni, assets, talker=assets.talker_adapter)[1])
    stats = talker.stats().adapters["reg_talker"]
    assert stats.loaded and stats.pinned and stats.requests == 1
    assert omni.remove_lora(32, stage_id=1) and 32 not in omni.list_loras(stage_id=1)
    assert not talker.stats().adapters["reg_talker"].loaded
