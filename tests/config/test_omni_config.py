"""Typed config resolution: every input path, precedence, ownership and LoRA rules."""

from __future__ import annotations

import json

import pytest

from vllm_omni.config import (
    DiffusionStageConfig,
    OmniStageLoRAConfig,
    VllmOmniConfig,
    resolve_pipeline_config,
)
from vllm_omni.config.fields import lora_engine_field_map
from vllm_omni.config.pipeline_registry import pipeline_for_model, registered_pipelines
from vllm_omni.errors import ConfigError


def resolve(name, deploy_config=None, **overrides):
    return VllmOmniConfig.from_pipeline_config(
        resolve_pipeline_config(name, None), cli_overrides=overrides, deploy_config=deploy_config
    )


def test_seed_repro_qwen3_tts_stage_keys():
    cfg = resolve("qwen3_tts", stage_0_enable_lora=True, stage_0_max_lora_rank=64)
    lora = cfg.stage_by_id(0).lora_config
    assert isinstance(lora, OmniStageLoRAConfig)
    assert repr(lora).startswith("OmniStageLoRAConfig(max_lora_rank=64, max_loras=1,")
    assert cfg.stage_by_id(1).lora_config is None


def test_seed_repro_qwen2_5_omni_stage_overrides():
    cfg = resolve(
        "qwen2_5_omni", stage_overrides={"0": {"enable_lora": True, "max_lora_rank": 64, "max_loras": 2}}
    )
    lora = cfg.stage_by_id(0).lora_config
    assert (lora.max_lora_rank, lora.max_loras, lora.max_cpu_loras) == (64, 2, 2)
    assert cfg.stage_by_id(1).lora_config is None
    assert cfg.stage_by_id(2).lora_config is None


def _lora_fields(cfg, stage_id=0):
    lora = cfg.stage_by_id(stage_id).lora_config
    return (
        None
        if lora is None
        else (lora.max_lora_rank, lora.max_loras, lora.max_cpu_loras, lora.target_modules)
    )


def test_every_input_path_resolves_to_the_same_typed_config(tmp_path):
    want = (32, 2, 4, ["q_proj", "v_proj"])
    opts = {"enable_lora": True, "max_lora_rank": 32, "max_loras": 2, "max_cpu_loras": 4}
    targets = ["q_proj", "v_proj"]
    yaml_path = tmp_path / "deploy.yaml"
    yaml_path.write_text(
        "stages:\n  - stage_id: 0\n    enable_lora: true\n    max_lora_rank: 32\n    max_loras: 2\n"
        "    engine_extras:\n      max_cpu_loras: 4\n      lora_target_modules: [q_proj, v_proj]\n"
    )
    paths = {
        "stage_overrides dict": resolve(
            "qwen3_tts", stage_overrides={0: {**opts, "lora_target_modules": targets}}
        ),
        "stage_overrides json": resolve(
            "qwen3_tts", stage_overrides=json.dumps({"0": {**opts, "target_modules": targets}})
        ),
        "stage_N keys": resolve(
            "qwen3_tts", **{f"stage_0_{k}": v for k, v in opts.items()}, stage_0_lora_target_modules=targets
        ),
        "deploy yaml": resolve("qwen3_tts", deploy_config=str(yaml_path)),
        "global on single stage": resolve("qwen2_5_omni_thinker_only", **opts, lora_target_modules=targets),
    }
    for name, cfg in paths.items():
        assert _lora_fields(cfg) == want, name
    # stage 1 of qwen3_tts is untouched on every path
    for name, cfg in paths.items():
        if cfg.pipeline.name == "qwen3_tts":
            assert cfg.stage_by_id(1).lora_config is None, name


def test_precedence_defaults_deploy_global_stage_scoped():
    deploy = {"stages": [{"stage_id": 0, "enable_lora": True, "max_lora_rank": 8, "max_loras": 3}]}
    cfg = resolve("qwen2_5_omni_thinker_only", deploy_config=deploy)
    assert _lora_fields(cfg)[:2] == (8, 3)
    # explicit global beats deploy
    cfg = resolve("qwen2_5_omni_thinker_only", deploy_config=deploy, max_lora_rank=16)
    assert _lora_fields(cfg)[:2] == (16, 3)
    # stage_overrides beats global, stage_N beats stage_overrides
    cfg = resolve(
        "qwen2_5_omni_thinker_only",
        deploy_config=deploy,
        max_lora_rank=16,
        stage_overrides={"0": {"max_lora_rank": 32}},
    )
    assert _lora_fields(cfg)[:2] == (32, 3)
    cfg = resolve(
        "qwen2_5_omni_thinker_only",
        deploy_config=deploy,
        stage_overrides={"0": {"max_lora_rank": 32}},
        stage_0_max_lora_rank=64,
    )
    assert _lora_fields(cfg)[:2] == (64, 3)
    # an explicit enable_lora=False switches a deploy-enabled stage off entirely
    cfg = resolve(
        "qwen2_5_omni_thinker_only", deploy_config=deploy, stage_overrides='{"0": {"enable_lora": false}}'
    )
    assert cfg.stage_by_id(0).lora_config is None


@pytest.mark.parametrize(
    "key", ["enable_lora", "max_lora_rank", "lora_target_modules", "fully_sharded_loras"]
)
@pytest.mark.parametrize("name", ["qwen2_5_omni", "qwen3_tts", "llm_chain"])
def test_global_vllm_lora_options_rejected_on_multi_stage(name, key):
    with pytest.raises(ValueError) as info:
        resolve(name, **{key: True if key != "lora_target_modules" else ["q_proj"]})
    msg = str(info.value)
    llm_ids = resolve_pipeline_config(name).stage_ids(kind="llm")
    assert key in msg and f"its LLM stages are {llm_ids}" in msg
    assert "stage_overrides=" in msg and "--stage-overrides" in msg


def test_global_lora_on_bagel_rejected_but_max_cpu_loras_sizes_diffusion_cache():
    with pytest.raises(ValueError, match=r"its LLM stages are \[0\]"):
        resolve("bagel", enable_lora=True)
    cfg = resolve("bagel", max_cpu_loras=6, stage_0_enable_lora=True, stage_0_max_lora_rank=32)
    assert cfg.stage_by_id(1).options == {"max_cpu_loras": 6}
    llm_lora = cfg.stage_by_id(0).lora_config
    assert (llm_lora.max_lora_rank, llm_lora.max_cpu_loras) == (32, 1)  # not 6: the global is diffusion's


def test_lora_options_without_enable_lora_have_no_effect():
    cfg = resolve("qwen3_tts", stage_0_max_lora_rank=64, stage_0_max_loras=4)
    assert cfg.stage_by_id(0).lora_config is None


def test_diffusion_stage_rejects_enable_lora():
    with pytest.raises(
        ValueError, match=r"Stage 1 \(diffusion\) does not accept vLLM LoRA option\(s\) \['enable_lora'\]"
    ):
        resolve("bagel", stage_1_enable_lora=True)
    with pytest.raises(ValueError, match=r"Stage 0 \(diffusion\) does not accept vLLM LoRA"):
        resolve("wan2_2_ti2v", enable_lora=True)
    cfg = resolve(
        "wan2_2_ti2v", lora_path="/a", lora_scale=0.5, lora_backend="peft", max_loras=2, max_cpu_loras=3
    )
    stage = cfg.stage_by_id(0)
    assert isinstance(stage, DiffusionStageConfig) and stage.lora_config is None
    assert stage.options == {
        "lora_path": "/a",
        "lora_scale": 0.5,
        "lora_backend": "peft",
        "max_loras": 2,
        "max_cpu_loras": 3,
    }


def test_distill_without_lora_path_rejected():
    with pytest.raises(ValueError, match="lora_backend='distill' needs lora_path"):
        resolve("wan2_2_ti2v", lora_backend="distill")


def test_misspelled_key_names_stage_type_key_and_suggestion():
    with pytest.raises(ValueError) as info:
        resolve("qwen3_tts", stage_overrides={"1": {"enable_loar": True}})
    assert str(info.value).startswith(
        "stage_overrides, stage 1 (llm_generation): unknown option 'enable_loar' (did you mean 'enable_lora'?)"
    )
    with pytest.raises(
        ValueError,
        match=r"^keyword argument 'max_lora_rnak': option 'max_lora_rnak' is not accepted by any stage.*"
        r"did you mean 'max_lora_rank'",
    ):
        resolve("qwen3_tts", max_lora_rnak=8)
    with pytest.raises(ValueError, match="'cpu_offload_gb'"):
        resolve("qwen2_5_omni_thinker_only", cpu_offload_gb=4)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[1]", "must be an object keyed by stage id"),
        ('{"0": 5}', r"stage_overrides\['0'\] must be an object of options for stage 0, got int"),
        (
            '{"9": {}}',
            r"stage_overrides: no stage\(s\) \[9\] in pipeline 'qwen3_tts', whose stages are \[0, 1\]",
        ),
        ('{"0": {"enable_lora": tru}}', "stage_overrides is not valid JSON"),
        ('{"zero": {}}', "keys must be stage ids"),
        ('{"-1": {}}', "keys must be stage ids"),
    ],
)
def test_malformed_stage_overrides(value, message):
    with pytest.raises(ValueError, match=message):
        resolve("qwen3_tts", stage_overrides=value)


def test_malformed_deploy_configs(tmp_path):
    with pytest.raises(ValueError, match=r"stage_id 0 is listed twice"):
        resolve("qwen3_tts", deploy_config={"stages": [{"stage_id": 0}, {"stage_id": 0}]})
    with pytest.raises(ValueError, match=r"deploy config: no stage\(s\) \[5\]"):
        resolve("qwen3_tts", deploy_config={"stages": [{"stage_id": 5}]})
    with pytest.raises(ValueError, match=r"\['max_loras'\] set both as stage fields and in engine_extras"):
        resolve(
            "qwen3_tts",
            deploy_config={"stages": [{"stage_id": 0, "max_loras": 1, "engine_extras": {"max_loras": 2}}]},
        )
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        resolve("qwen3_tts", deploy_config=str(bad))
    with pytest.raises(ValueError, match="cannot read deploy config"):
        resolve("qwen3_tts", deploy_config=str(tmp_path / "missing.yaml"))
    with pytest.raises(
        ValueError, match=r"^deploy config, stages\[0\], stage 0 \(llm_ar\): unknown option 'enable_loar'"
    ):
        resolve(
            "qwen3_tts", deploy_config={"stages": [{"stage_id": 0, "engine_extras": {"enable_loar": True}}]}
        )


def test_upstream_lora_validation_runs_at_construction():
    with pytest.raises(
        ValueError,
        match=r"^stage_0_max_lora_rank, stage 0 \(llm_ar\): max_lora_rank=63: Input should be 1, 8, 16",
    ):
        resolve("qwen3_tts", stage_0_enable_lora=True, stage_0_max_lora_rank=63)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        resolve("qwen3_tts", stage_0_enable_lora=True, stage_0_max_loras=2, stage_0_max_cpu_loras=1)
    cfg = resolve("qwen3_tts", stage_0_enable_lora=True, stage_0_max_loras=3, stage_0_max_cpu_loras=0)
    assert cfg.stage_by_id(0).lora_config.max_cpu_loras == 3  # non-positive means unset
    with pytest.raises(
        ValueError, match=r"^stage_0_gpu_memory_utilization, stage 0 \(llm_ar\): gpu_memory_utilization=5.0: "
    ):
        resolve("qwen3_tts", stage_0_gpu_memory_utilization=5.0)


def test_lora_field_map_is_generated_from_upstream_with_alias():
    import dataclasses

    from vllm.config import LoRAConfig
    from vllm.engine.arg_utils import EngineArgs

    mapping = lora_engine_field_map()
    assert mapping["target_modules"] == "lora_target_modules"
    ea = {f.name for f in dataclasses.fields(EngineArgs)}
    for field in dataclasses.fields(LoRAConfig):
        expected = "lora_target_modules" if field.name == "target_modules" else field.name
        assert (mapping.get(field.name) == expected) == (expected in ea)


def test_stage_configs_are_msgpack_transport_safe():
    import dataclasses

    import msgspec

    from vllm_omni.config.stage_config import make_stage_config

    cfg = resolve(
        "bagel",
        max_cpu_loras=3,
        stage_overrides={
            "0": {"enable_lora": True, "max_lora_rank": 32, "target_modules": ["q_proj"], "dtype": "float32"}
        },
    )
    for stage in cfg.stages:
        fields = {f.name: getattr(stage, f.name) for f in dataclasses.fields(stage) if f.init}
        back = make_stage_config(**msgspec.msgpack.decode(msgspec.msgpack.encode(fields)))
        assert back == stage and type(back) is type(stage)
    assert cfg.stage_by_id(0).lora_config.max_lora_rank == 32
    assert cfg.stage_by_id(1).diffusion_config.max_cpu_loras == 3


def test_registry_and_unknown_pipeline():
    names = registered_pipelines()
    for name in (
        "qwen3_tts",
        "qwen2_5_omni",
        "qwen2_5_omni_thinker_only",
        "bagel",
        "wan2_2_ti2v",
        "llm_chain",
    ):
        assert name in names
    kinds = {n: [s.stage_type for s in resolve_pipeline_config(n).stages] for n in names}
    assert kinds["qwen3_tts"] == ["llm_ar", "llm_generation"]
    assert kinds["qwen2_5_omni"] == ["llm_ar", "llm_ar", "llm_generation"]
    assert kinds["bagel"] == ["llm_ar", "diffusion"]
    assert kinds["wan2_2_ti2v"] == ["diffusion"]
    with pytest.raises(ValueError, match="unknown pipeline 'nope'; registered pipelines: .*qwen3_tts"):
        resolve_pipeline_config("nope")


def test_default_pipeline_from_model_directory(tmp_path):
    llm = tmp_path / "llm"
    llm.mkdir()
    (llm / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    )
    p = pipeline_for_model(str(llm))
    assert [(s.stage_type, s.model_arch) for s in p.stages] == [("llm_ar", "Qwen2ForCausalLM")]
    diff = tmp_path / "diff"
    diff.mkdir()
    (diff / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    p = pipeline_for_model(str(diff))
    assert [(s.stage_type, s.model_arch) for s in p.stages] == [("diffusion", "ZImagePipeline")]
    with pytest.raises(ValueError, match="has neither model_index.json"):
        pipeline_for_model(str(tmp_path))


def test_errors_name_the_input_and_stage(tmp_path):
    """Each input path is named in the message: stage_overrides, stage_N_<key>, a deploy YAML file."""
    with pytest.raises(
        ConfigError, match=r"^stage_overrides, stage 0 \(llm_ar\): unknown option 'enable_loar'"
    ):
        resolve("qwen3_tts", stage_overrides='{"0": {"enable_loar": true}}')
    with pytest.raises(
        ConfigError, match=r"^stage_1_enable_loar, stage 1 \(llm_generation\): unknown option"
    ):
        resolve("qwen3_tts", stage_1_enable_loar=True)
    deploy = tmp_path / "d.yaml"
    deploy.write_text("stages:\n  - stage_id: 0\n    engine_extras: {enable_lora: true, max_lora_rank: 63}\n")
    with pytest.raises(
        ConfigError, match=rf"^deploy config '{deploy}', stages\[0\], stage 0 \(llm_ar\): max_lora_rank=63: "
    ):
        resolve("qwen3_tts", deploy_config=str(deploy))
    # the last input that set a value is the one named
    with pytest.raises(ConfigError, match=r"^stage_0_max_lora_rank, stage 0 \(llm_ar\): max_lora_rank=63"):
        resolve("qwen3_tts", stage_overrides={"0": {"enable_lora": True}}, stage_0_max_lora_rank=63)


def test_deploy_schema_errors_are_rewritten(tmp_path):
    deploy = tmp_path / "d.yaml"
    deploy.write_text("pipline: x\nstages:\n  - stage_id: 0\n  - stage_id: one\n")
    with pytest.raises(ConfigError) as info:
        resolve("qwen3_tts", deploy_config=str(deploy))
    message = str(info.value)
    assert f"deploy config '{deploy}', stages[1].stage_id: Input should be a valid integer" in message
    assert f"deploy config '{deploy}', pipline: unknown key (did you mean 'pipeline'?)" in message
    assert "errors.pydantic.dev" not in message and "validation error" not in message
