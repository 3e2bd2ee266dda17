"""The typed diffusion stage config: one validator, options derived from its fields, layering."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from vllm_omni.config import DiffusionStageConfig, VllmOmniConfig, resolve_pipeline_config
from vllm_omni.config.diffusion import LORA_BACKENDS, OmniDiffusionConfig
from vllm_omni.config.fields import DIFFUSION_FIELDS, DIFFUSION_LORA_FIELDS, owned_keys
from vllm_omni.errors import ConfigError


def resolve(name, **overrides):
    return VllmOmniConfig.from_pipeline_config(resolve_pipeline_config(name), cli_overrides=overrides)


def test_option_names_are_the_dataclass_fields():
    fields = {f.name: f for f in dataclasses.fields(OmniDiffusionConfig)}
    assert owned_keys("diffusion") == DIFFUSION_FIELDS
    assert set(fields) >= DIFFUSION_FIELDS and "model" not in DIFFUSION_FIELDS
    # runtime-internal fields are no stage options
    assert not {"keep_base_weights", "distributed_init_method", "model_index"} & DIFFUSION_FIELDS
    assert {
        "lora_path",
        "lora_scale",
        "lora_backend",
        "max_loras",
        "max_cpu_loras",
        "max_lora_rank",
        "lora_merge",
    } == DIFFUSION_LORA_FIELDS
    assert {"seed", "max_batch_size", "enforce_eager", "dtype", "pipeline_backend"} <= DIFFUSION_FIELDS


def test_stage_carries_typed_config_with_defaults_and_explicit_options():
    stage = resolve("wan2_2_ti2v", lora_path="/a", max_loras=2, seed=3, max_batch_size=4).stage_by_id(0)
    assert isinstance(stage, DiffusionStageConfig)
    cfg = stage.diffusion_config
    assert isinstance(cfg, OmniDiffusionConfig) and cfg.model is None
    assert (cfg.lora_path, cfg.max_loras, cfg.seed, cfg.max_batch_size) == ("/a", 2, 3, 4)
    assert cfg.max_cpu_loras == 3  # max_loras + the pinned start-up adapter
    assert (cfg.lora_backend, cfg.lora_scale, cfg.pipeline_backend) == ("peft", 1.0, "auto")
    # the explicitly set options stay what they were
    assert stage.options == {"lora_path": "/a", "max_loras": 2, "seed": 3, "max_batch_size": 4}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lora_backend": "lycoris"}, r"lora_backend must be one of \['peft', 'distill'\], got 'lycoris'"),
        ({"pipeline_backend": "onnx"}, r"pipeline_backend must be one of"),
        ({"batching": "steps"}, r"batching must be one of \['request', 'step'\], got 'steps'"),
        ({"dtype": "int8"}, r"dtype must be a torch.dtype or one of"),
        ({"device": "tpu"}, r"device must be 'cpu', 'cuda' or None"),
        ({"max_loras": 2, "max_cpu_loras": 1}, r"max_cpu_loras \(1\) must be >= max_loras \(2\)"),
        # one set of limits with a request's adapter scale (MAX_ADAPTER_SCALE)
        ({"lora_scale": 1e6}, r"lora_scale must be a finite number in \[-100, 100\], got float: 1000000.0"),
        ({"compile_backend": "inductr"}, r"compile_backend must be a registered dynamo backend: 'inductor', "),
    ],
)
def test_every_option_check_runs_at_resolution_with_config_error(options, message):
    with pytest.raises(
        ConfigError,
        match=r"^keyword argument '\w+'( and keyword argument '\w+')*, stage 0 \(diffusion\): " + message,
    ):
        resolve("wan2_2_ti2v", **options)


def test_direct_construction_uses_the_same_checks_without_a_stage():
    with pytest.raises(ConfigError, match=r"^max_batch_size must be >= 1 \(an integer\), got int: 0$"):
        OmniDiffusionConfig(max_batch_size=0)
    with pytest.raises(ConfigError, match="lora_backend='distill' needs lora_path"):
        OmniDiffusionConfig(lora_backend="distill")
    assert LORA_BACKENDS == ("peft", "distill")


def test_with_model_checks_the_directory(tmp_path):
    cfg = OmniDiffusionConfig(max_loras=2)
    with pytest.raises(ConfigError, match="is not a directory"):
        cfg.with_model(tmp_path / "missing")
    with pytest.raises(ConfigError, match="has no model_index.json"):
        cfg.with_model(tmp_path)


def test_config_package_does_not_import_the_diffusion_runtime():
    code = (
        "import sys, vllm_omni.config, vllm_omni.config.diffusion; "
        "bad = sorted(m for m in sys.modules if m.startswith(('vllm_omni.diffusion', 'vllm_omni.engine', "
        "'diffusers'))); print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_auto_runs_every_wan_image_to_video_layout_in_tree(tmp_path):
    """Wan2.2 TI2V-5B image-to-video (``expand_timesteps``) is one of the in-tree layouts: ``auto`` picks the
    in-tree pipeline for that directory as for the others; ``diffusers`` still picks diffusers'."""
    import json

    for expand in (True, False):
        index = {"_class_name": "WanImageToVideoPipeline", "expand_timesteps": expand}
        (tmp_path / "model_index.json").write_text(json.dumps(index))
        assert OmniDiffusionConfig().with_model(tmp_path).use_in_tree
        assert not OmniDiffusionConfig(pipeline_backend="diffusers").with_model(tmp_path).use_in_tree
