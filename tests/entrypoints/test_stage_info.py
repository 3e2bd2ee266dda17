"""``EntryStageInfo``: what the HTTP layer knows about a pipeline, built once from its config."""

from __future__ import annotations

import pytest

from vllm_omni.entrypoints.async_omni import AsyncOmni
from vllm_omni.entrypoints.omni_base import build_omni_config
from vllm_omni.entrypoints.stage_info import describe_entry_stage
from vllm_omni.lora.request import startup_lora_request


def test_llm_entry_stage(tiny_llm_assets):
    model = str(tiny_llm_assets.model_dir)
    info = describe_entry_stage(build_omni_config(model, max_model_len=256, trust_remote_code=True))
    assert info.is_llm and info.label == "Stage 0 (llm_ar)" and info.pipeline == "default_llm"
    assert info.output_kinds == {"text"} and info.stage_is_llm == (True,)
    assert info.max_adapters_per_request == 1 and info.startup_adapters == ()
    assert info.max_model_len == 256 and info.tokenizer == model and info.trust_remote_code
    assert not info.accepts_input_image and info.model == model


def test_llm_to_diffusion_outputs_images(tiny_llm_assets):
    info = describe_entry_stage(build_omni_config(str(tiny_llm_assets.model_dir), "llm_to_diffusion"))
    assert info.is_llm and info.stage_is_llm == (True, False)
    assert info.has_llm_stage and info.has_diffusion_stage
    assert info.output_kinds == {"image"} and info.max_model_len is None


def test_diffusion_startup_adapters_and_default_scale(tiny_z_image_dir, tmp_path):
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    config = build_omni_config(str(tiny_z_image_dir), lora_path=paths, lora_scale=0.5, max_loras=3)
    info = describe_entry_stage(config)
    assert not info.is_llm and info.output_kinds == {"image"} and info.tokenizer is None
    assert info.max_adapters_per_request == 3
    assert info.startup_lora_paths == tuple(paths)
    # the very requests the diffusion worker pre-loads and pins
    assert info.startup_adapters == tuple(startup_lora_request(p) for p in paths)
    assert info.default_lora_scale(info.startup_adapters[1].lora_int_id) == 0.5
    assert info.default_lora_scale(12345) == 1.0
    assert not info.accepts_input_image  # the in-tree Z-Image pipeline is text-to-image


def test_distill_backend_preloads_nothing(tiny_z_image_dir, tmp_path):
    path = str(tmp_path / "a.safetensors")
    config = build_omni_config(str(tiny_z_image_dir), lora_path=path, lora_backend="distill", lora_scale=0.5)
    info = describe_entry_stage(config)
    assert info.startup_lora_paths == (path,) and info.startup_adapters == ()
    assert info.default_lora_scale(startup_lora_request(path).lora_int_id) == 1.0


def test_diffusers_backend_accepts_an_input_image(tiny_z_image_dir):
    info = describe_entry_stage(build_omni_config(str(tiny_z_image_dir), pipeline_backend="diffusers"))
    assert info.accepts_input_image


def test_entry_stage_info_is_computed_once(tiny_llm_assets, monkeypatch):
    omni = AsyncOmni.__new__(AsyncOmni)  # no engines: only the config is needed
    omni.config = build_omni_config(str(tiny_llm_assets.model_dir))
    calls = []
    real = describe_entry_stage

    def counting(config):
        calls.append(config)
        return real(config)

    monkeypatch.setattr("vllm_omni.entrypoints.omni_base.describe_entry_stage", counting)
    assert omni.entry_stage_info is omni.entry_stage_info
    assert calls == [omni.config]
    with pytest.raises(AttributeError):  # frozen
        omni.entry_stage_info.is_llm = False


def test_video_pipeline_outputs_video():
    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan

    info = describe_entry_stage(build_omni_config(str(ensure_tiny_wan(test_assets_root()))))
    assert info.output_kinds == {"video"} and not info.is_llm
