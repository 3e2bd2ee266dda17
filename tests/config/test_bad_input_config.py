"""Hostile / careless configuration: each bad value fails at resolution with a ValueError naming
the stage, key or file, and never turns into another setting (``bool("false")`` is ``True``)."""

from __future__ import annotations

import pytest

from vllm_omni.entrypoints.omni_base import build_omni_config


@pytest.fixture(scope="module")
def llm_dir(tiny_llm_assets):
    return str(tiny_llm_assets.model_dir)


@pytest.fixture(scope="module")
def diffusion_dir():
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return str(ensure_tiny_diffusion_assets(test_assets_root())["z_image"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"enable_lora": "false"},
            r"^keyword argument 'enable_lora', stage 0 \(llm_ar\): enable_lora must be true or false, got 'false'",
        ),
        ({"stage_overrides": {"0": {"enable_lora": "no"}}}, "enable_lora must be true or false"),
        ({"stage_overrides": {"0": {1: 2}}}, r"stage_overrides\['0'\]: option names must be strings"),
        ({"stage_overrides": {"²": {}}}, "keys must be stage ids"),
        ({"stage_overrides": {"０": {}}}, "keys must be stage ids"),
        (
            {"final_output": "no"},
            r"^keyword argument 'final_output', stage 0 \(llm_ar\): final_output must be true or false",
        ),
        ({"engine_input_source": "x"}, "engine_input_source must be a list of stage ids"),
        ({"engine_input_source": 5}, "engine_input_source must be a list of stage ids"),
        ({"model_arch": 5}, "model_arch must be a string"),
    ],
)
def test_llm_stage_option_types(llm_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_omni_config(llm_dir, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_loras": "2"}, r"max_loras must be >= 1 \(an integer\), got str"),
        ({"max_cpu_loras": "2"}, r"max_cpu_loras must be >= 1 \(an integer"),
        ({"max_batch_size": "abc"}, r"max_batch_size must be >= 1 \(an integer\)"),
        ({"max_batch_size": 0}, r"max_batch_size must be >= 1 \(an integer\)"),
        ({"max_batch_size": 2.5}, r"max_batch_size must be >= 1 \(an integer\)"),
        ({"tensor_parallel_size": True}, r"tensor_parallel_size must be >= 1 \(an integer\)"),
        ({"lora_scale": "big"}, "lora_scale must be a finite number"),
        ({"lora_scale": float("nan")}, "lora_scale must be a finite number"),
        ({"lora_path": 5}, "lora_path must be a path string"),
        ({"lora_path": []}, "lora_path must be a path string"),
        ({"seed": "abc"}, "seed must be an integer"),
        ({"enforce_eager": "yes"}, "enforce_eager must be true or false"),
        ({"dtype": 5}, "dtype must be a string"),
    ],
)
def test_diffusion_stage_option_types(diffusion_dir, kwargs, message):
    with pytest.raises(ValueError, match=r"^keyword argument '\w+', stage 0 \(diffusion\): " + message):
        build_omni_config(diffusion_dir, **kwargs)


def test_model_argument_problems_name_the_path(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=f"model directory '{missing}' does not exist"):
        build_omni_config(str(missing))
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file, not a model directory"):
        build_omni_config(str(a_file))
    with pytest.raises(ValueError, match="model must be a model directory or hub id string, got int"):
        build_omni_config(5)
    for name, text, message in [
        ("config.json", "{bad", "cannot read config.json"),
        ("config.json", "[1]", "config.json must hold a JSON object"),
        ("model_index.json", "{bad", "cannot read model_index.json"),
        ("model_index.json", "[]", "model_index.json must hold a JSON object"),
    ]:
        model = tmp_path / f"m{len(text)}{name}"
        model.mkdir()
        (model / name).write_text(text)
        with pytest.raises(ValueError, match=f"model directory '{model}': {message}"):
            build_omni_config(str(model))


def test_model_path_object_is_accepted(tiny_llm_assets):
    config = build_omni_config(tiny_llm_assets.model_dir)
    assert config.entry_stage.model == str(tiny_llm_assets.model_dir)


def test_deploy_yaml_edge_cases(llm_dir, tmp_path):
    bool_id = tmp_path / "bool_id.yaml"
    bool_id.write_text("stages:\n- stage_id: true\n  max_model_len: 128\n")
    with pytest.raises(ValueError, match="stage_id must be an integer, got True"):
        build_omni_config(llm_dir, deploy_config=str(bool_id))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"stages: \xff\xfe\n")
    with pytest.raises(ValueError, match=f"deploy config '{binary}' is not UTF-8 text"):
        build_omni_config(llm_dir, deploy_config=str(binary))
    no_str = tmp_path / "no_str.yaml"
    no_str.write_text("stages:\n- stage_id: 0\n  enable_lora: 'false'\n")
    with pytest.raises(ValueError, match="enable_lora must be true or false"):
        build_omni_config(llm_dir, deploy_config=str(no_str))
