"""``EntryStageInfo``: what the HTTP layer knows about a pipeline, built once from its config and
from what each running stage says about itself (``StageDescription``, not guessed from names).

The descriptions here are written by hand so that each rule is checked alone; that the runtimes
describe themselves correctly is checked where they run (``tests/engine/test_stage_descriptions.py``,
the diffusion, omni and worker tests).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm import SamplingParams

from vllm_omni.engine.protocols import AdapterCapabilities, StageDescription
from vllm_omni.entrypoints.async_omni import AsyncOmni
from vllm_omni.entrypoints.omni_base import build_omni_config
from vllm_omni.entrypoints.stage_info import describe_entry_stage
from vllm_omni.inputs.audio import AudioParams
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import startup_lora_request


def _llm(stage_id=0, max_model_len=512, lora=True, **kw) -> StageDescription:
    adapters = AdapterCapabilities("llm", 2, 1, 16) if lora else None
    return StageDescription(
        stage_id, f"Stage {stage_id}", "text", frozenset({"text", "token_ids"}), SamplingParams,
        max_model_len=max_model_len, adapters=adapters, **kw,
    )  # fmt: skip


def _diffusion(stage_id=0, kind="image", inputs=("text",), max_loras=1, startup=()) -> StageDescription:
    return StageDescription(
        stage_id, f"Stage {stage_id}", kind, frozenset(inputs), OmniDiffusionSamplingParams,
        max_batch_size=4, adapters=AdapterCapabilities("diffusion", max_loras, max_loras, 64, ("transformer",), startup),
    )  # fmt: skip


def test_llm_entry_stage(tiny_llm_assets):
    model = str(tiny_llm_assets.model_dir)
    config = build_omni_config(model, max_model_len=256, trust_remote_code=True)
    info = describe_entry_stage(config, [_llm(max_model_len=256)])
    assert info.is_llm and info.label == "Stage 0 (llm_ar)" and info.pipeline == "default_llm"
    assert info.output_kinds == {"text"} and info.stage_is_llm == (True,)
    assert info.max_adapters_per_request == 1 and info.startup_adapters == ()
    assert info.max_model_len == 256 and info.tokenizer == model and info.trust_remote_code
    assert not info.accepts_input_image and info.model == model
    assert info.stages == (_llm(max_model_len=256),)


def test_max_model_len_is_the_engines_not_the_option(tiny_llm_assets):
    """No ``max_model_len`` option: the front end still knows the context the engine resolved."""
    config = build_omni_config(str(tiny_llm_assets.model_dir))
    assert "max_model_len" not in config.entry_stage.options
    assert describe_entry_stage(config, [_llm(max_model_len=1024)]).max_model_len == 1024


def test_llm_to_diffusion_outputs_what_the_last_stage_describes(tiny_llm_assets):
    config = build_omni_config(str(tiny_llm_assets.model_dir), "llm_to_diffusion")
    info = describe_entry_stage(config, [_llm(), _diffusion(1)])
    assert info.is_llm and info.stage_is_llm == (True, False)
    assert info.has_llm_stage and info.has_diffusion_stage
    assert info.output_kinds == {"image"}
    # the same config, a diffusion stage that says it makes video: no class name decides it
    assert describe_entry_stage(config, [_llm(), _diffusion(1, "video")]).output_kinds == {"video"}


def test_diffusion_adapters_come_from_the_description(tiny_z_image_dir, tmp_path):
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    config = build_omni_config(str(tiny_z_image_dir), lora_path=paths, lora_scale=0.5, max_loras=3)
    startup = tuple(startup_lora_request(p) for p in paths)
    info = describe_entry_stage(config, [_diffusion(max_loras=3, startup=startup)])
    assert not info.is_llm and info.output_kinds == {"image"} and info.tokenizer is None
    assert info.max_adapters_per_request == 3
    assert info.startup_lora_paths == tuple(paths)
    assert info.startup_adapters == startup
    assert info.default_lora_scale(info.startup_adapters[1].lora_int_id) == 0.5
    assert info.default_lora_scale(12345) == 1.0
    assert not info.accepts_input_image


def test_an_input_image_is_accepted_when_the_stage_says_so(tiny_z_image_dir):
    config = build_omni_config(str(tiny_z_image_dir), pipeline_backend="diffusers")
    assert describe_entry_stage(config, [_diffusion(inputs=("text", "image"))]).accepts_input_image
    assert not describe_entry_stage(config, [_diffusion()]).accepts_input_image


def test_audio_outputs_and_voices_come_from_the_description(tiny_llm_assets):
    config = build_omni_config(str(tiny_llm_assets.model_dir), "llm_chain")
    audio = StageDescription(
        1, "Stage 1", "audio", frozenset({"stage_payload"}), AudioParams, voices=("Chelsie", "Ethan")
    )
    info = describe_entry_stage(config, [_llm(), audio])
    assert info.output_kinds == {"audio"} and info.stage_is_audio == (False, True)
    assert info.voices == ("Chelsie", "Ethan")


def test_one_description_per_stage(tiny_llm_assets):
    config = build_omni_config(str(tiny_llm_assets.model_dir), "llm_chain")
    with pytest.raises(ValueError, match="1 stage descriptions for 2 stages"):
        describe_entry_stage(config, [_llm()])


def test_entry_stage_info_is_computed_once(tiny_llm_assets, monkeypatch):
    omni = AsyncOmni.__new__(AsyncOmni)  # no engines: the config and the stages' descriptions
    omni.config = build_omni_config(str(tiny_llm_assets.model_dir))
    omni._orchestrator = type("Described", (), {"descriptions": [_llm()]})()
    calls = []
    real = describe_entry_stage

    def counting(config, stages):
        calls.append((config, list(stages)))
        return real(config, stages)

    monkeypatch.setattr("vllm_omni.entrypoints.omni_base.describe_entry_stage", counting)
    assert omni.entry_stage_info is omni.entry_stage_info
    assert calls == [(omni.config, [_llm()])]
    with pytest.raises(AttributeError):  # frozen
        omni.entry_stage_info.is_llm = False


def test_one_params_object_is_the_requests_and_stages_with_defaults_keep_theirs(
    tiny_omni_assets, tiny_llm_assets
):
    """Issue 21 rule 8, the rule itself (no engines): one ``SamplingParams`` on ``qwen2_5_omni`` is the
    thinker's; the talker keeps its defaults with the object's seed, code2wav ``AudioParams`` with it;
    a per-stage list sets any stage; on ``llm_chain`` one object reaches both LLM stages."""
    from vllm_omni.stages.qwen2_5_omni.pipeline import TALKER_DEFAULTS

    omni = AsyncOmni.__new__(AsyncOmni)
    omni.config = build_omni_config(str(tiny_omni_assets.model_dir), "qwen2_5_omni")
    omni._orchestrator = SimpleNamespace(  # what the three running stages would describe
        descriptions=[
            _llm(0),
            StageDescription(1, "Stage 1", "codec", frozenset({"stage_payload"}), SamplingParams),
            StageDescription(2, "Stage 2", "audio", frozenset({"stage_payload"}), AudioParams),
        ]
    )
    one = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, seed=3)
    thinker, talker, audio = omni._stage_params(one)
    assert thinker is one
    assert (talker.max_tokens, talker.min_tokens, talker.temperature, talker.seed) == (
        TALKER_DEFAULTS["max_tokens"],
        0,
        TALKER_DEFAULTS["temperature"],
        3,
    )
    assert audio == AudioParams(seed=3)
    assert omni.entry_stage_info.stage_defaults[1].seed is None  # the shared default is not changed
    unseeded = omni._stage_params(SamplingParams(max_tokens=4))
    assert unseeded[1].seed is None and unseeded[2] == AudioParams()
    own = SamplingParams(temperature=0, max_tokens=7, min_tokens=2)
    assert omni._stage_params([one, own, None])[1:] == [own, AudioParams()]
    only_audio = AudioParams(voice="Ethan")
    assert omni._stage_params(only_audio)[2] is only_audio
    chain = AsyncOmni.__new__(AsyncOmni)
    chain.config = build_omni_config(str(tiny_llm_assets.model_dir), "llm_chain")
    chain._orchestrator = SimpleNamespace(descriptions=[_llm(0), _llm(1)])
    assert chain._stage_params(one) == [one, one]


def test_one_seeded_params_object_seeds_every_stage_and_changes_nothing_passed_in(tiny_llm_assets):
    """Issue 35 item 8, the rule itself (no engines): on ``llm_to_diffusion`` one seeded params object
    of either stage's type gives the other stage its default params with that seed (an LLM stage:
    modulo 2**63, as vLLM's seeds are int64 and -1 unseeded); a stage's own seed and a per-stage list
    are kept as given; the objects passed in are not changed."""
    omni = AsyncOmni.__new__(AsyncOmni)
    omni.config = build_omni_config(str(tiny_llm_assets.model_dir), "llm_to_diffusion")
    omni._orchestrator = SimpleNamespace(descriptions=[_llm(0), _diffusion(1)])
    image = OmniDiffusionSamplingParams(num_inference_steps=2, seed=7)
    llm, diffusion = omni._stage_params(image)
    assert diffusion is image and llm.seed == 7 and llm.max_tokens == SamplingParams().max_tokens
    text = SamplingParams(max_tokens=3, seed=5)
    llm, diffusion = omni._stage_params(text)
    assert llm is text and diffusion == OmniDiffusionSamplingParams(seed=5)
    for seed, llm_seed in ((2**64 - 1, 2**63 - 1), (-1, 2**63 - 1), (2**63, 0)):
        assert omni._stage_params(OmniDiffusionSamplingParams(seed=seed))[0].seed == llm_seed
    unseeded = SamplingParams(max_tokens=3)
    assert omni._stage_params([text, None])[1] == OmniDiffusionSamplingParams()
    assert omni._stage_params([unseeded, image])[0] is unseeded and unseeded.seed is None
    assert omni._stage_params(None)[0].seed is None and image.seed == 7
