"""Input validation of the diffusion config, sampling params and pipelines."""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_inference_steps": 0}, r"num_inference_steps must be an integer >= 1, got 0"),
        ({"num_inference_steps": -3}, r"num_inference_steps must be an integer >= 1"),
        ({"height": 0}, r"height must be a positive integer \(multiple of 16\)"),
        ({"width": -16}, r"width must be a positive integer"),
        ({"guidance_scale": -1.0}, r"guidance_scale must be >= 0"),
        ({"num_images_per_prompt": 0}, r"num_images_per_prompt must be an integer >= 1"),
        ({"output_type": "jpeg"}, r"output_type must be one of \['pil', 'latent', 'np', 'pt'\], got 'jpeg'"),
        ({"lora_requests": ["a"], "lora_scales": [1.0, 2.0]}, r"lora_scales must be empty or have one entry"),
    ],
)
def test_sampling_params_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OmniDiffusionSamplingParams(**kwargs)


def test_sampling_params_defaults():
    sp = OmniDiffusionSamplingParams()
    assert sp.lora_requests == [] and sp.lora_scales == []
    assert sp.num_inference_steps == 50 and sp.output_type == "pil"


def test_config_defaults(tiny_z_image_dir):
    cfg = OmniDiffusionConfig(model=str(tiny_z_image_dir))
    assert cfg.class_name == "ZImagePipeline" and cfg.use_in_tree
    assert cfg.max_cpu_loras == cfg.max_loras == 1
    assert cfg.lora_scale == 1.0 and cfg.lora_backend == "peft" and cfg.lora_path is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pipeline_backend": "onnx"}, r"pipeline_backend must be one of \['auto', 'in_tree', 'diffusers'\]"),
        ({"tensor_parallel_size": 0}, r"tensor_parallel_size must be >= 1 \(an integer\), got int: 0"),
        ({"dtype": "int8"}, r"dtype must be a torch.dtype or one of"),
        ({"device": "tpu"}, r"device must be 'cpu', 'cuda' or None"),
        ({"lora_backend": "lycoris"}, r"lora_backend must be one of \['peft', 'distill'\]"),
        ({"max_loras": 0}, r"max_loras must be >= 1"),
        ({"lora_path": 3}, r"lora_path must be a path string or a non-empty list of path strings"),
        ({"lora_path": ["a", None]}, r"lora_path must be a path string or a non-empty list"),
        ({"lora_scale": "x"}, r"lora_scale must be a finite number"),
        ({"max_loras": 2, "max_cpu_loras": 1}, r"max_cpu_loras \(1\) must be >= max_loras \(2\)"),
    ],
)
def test_config_errors(tiny_z_image_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        OmniDiffusionConfig(model=str(tiny_z_image_dir), **kwargs)


def test_config_path_errors(tmp_path, tiny_z_image_dir, tiny_sd3_dir):
    with pytest.raises(ValueError, match="is not a directory"):
        OmniDiffusionConfig(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="has no model_index.json"):
        OmniDiffusionConfig(model=str(tmp_path))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_z_image_dir, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(ValueError, match=r"lacks component folders \['vae'\]"):
        OmniDiffusionConfig(model=str(broken))
    # Unknown pipeline class for the in-tree backend.
    with pytest.raises(
        ValueError,
        match=r"unknown pipeline class 'StableDiffusion3Pipeline'.*in-tree pipelines: \['ZImagePipeline', 'QwenImagePipeline'",
    ):
        OmniDiffusionConfig(model=str(tiny_sd3_dir), pipeline_backend="in_tree")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs an in-tree pipeline"):
        OmniDiffusionConfig(model=str(tiny_sd3_dir), tensor_parallel_size=2)
    odd = tmp_path / "odd"
    shutil.copytree(tiny_z_image_dir, odd)
    index = json.loads((odd / "model_index.json").read_text())
    index["_class_name"] = "MadeUpPipeline"
    (odd / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="unknown pipeline class 'MadeUpPipeline'"):
        OmniDiffusionConfig(model=str(odd), pipeline_backend="in_tree")
    with pytest.raises(
        ValueError, match="unknown pipeline class 'MadeUpPipeline': neither an in-tree pipeline"
    ):
        OmniDiffusionConfig(model=str(odd))


@pytest.mark.parametrize(("height", "width", "field"), [(40, 32, "height"), (32, 24, "width")])
def test_size_not_multiple_of_vae_factor(z_image_engine, height, width, field):
    sp = OmniDiffusionSamplingParams(height=height, width=width, num_inference_steps=1)
    with pytest.raises(ValueError, match=rf"{field} must be a multiple of 16 for this model, got"):
        z_image_engine.generate(["x"], sp)


def test_negative_prompt_count_mismatch(z_image_engine):
    sp = OmniDiffusionSamplingParams(
        height=32, width=32, num_inference_steps=1, guidance_scale=1.0, negative_prompt=["a", "b", "c"]
    )
    with pytest.raises(ValueError, match="negative_prompt has 3 entries for 2 prompts"):
        z_image_engine.generate(["x", "y"], sp)


def test_in_tree_pipeline_refuses_extra_args_it_would_ignore(z_image_engine):
    sp = OmniDiffusionSamplingParams(
        height=32, width=32, num_inference_steps=1, extra_args={"cfg_truncation": 0.5}
    )
    with pytest.raises(
        ValueError, match=r"extra_args \['cfg_truncation'\] are not used by the in-tree ZImagePipeline"
    ):
        z_image_engine.generate(["x"], sp)
    sp = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=1, guidance_scale=1.0)
    assert len(z_image_engine.generate(["x"], sp)[0].images) == 1
