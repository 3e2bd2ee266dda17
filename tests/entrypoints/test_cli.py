"""The serve command line resolves to the same typed config as the Python API, with the same errors."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests import preload
from tests.entrypoints.server_utils import console_script, server_env
from vllm_omni.config.overrides import CLI_INPUT_NAMES
from vllm_omni.entrypoints.cli import main as cli_main
from vllm_omni.entrypoints.cli.serve import parse_serve_argv
from vllm_omni.entrypoints.omni_base import build_omni_config


def py_config(model, pipeline=None, deploy_config=None, **kwargs):
    """What ``Omni(model, pipeline=..., deploy_config=..., **kwargs)`` resolves."""
    return build_omni_config(model, pipeline, deploy_config, **kwargs)


def assert_same_config(cli, py):
    from vllm_omni.engine.stage_engine_args import project_stage_engine_kwargs

    assert cli.pipeline.name == py.pipeline.name
    assert cli.stages == py.stages
    for a, b in zip(cli.stages, py.stages):
        assert a.options == b.options and a.lora_config == b.lora_config
        if a.is_llm:
            assert project_stage_engine_kwargs(a) == project_stage_engine_kwargs(b)


def test_single_stage_llm_flags_match_omni_kwargs(tiny_llm_assets):
    model = str(tiny_llm_assets.model_dir)
    launch, settings = parse_serve_argv(
        [
            model,
            "--omni",
            "--enable-lora",
            "--max-lora-rank",
            "16",
            "--max-loras",
            "2",
            "--max-cpu-loras",
            "4",
        ]
        + ["--lora-target-modules", "q_proj", "v_proj", "--max-model-len", "256", "--dtype", "float32"]
        + [
            "--served-model-name",
            "tiny",
            "--port",
            "9001",
            "--lora-modules",
            f"a={tiny_llm_assets.adapter_a}",
        ]
    )
    kwargs = dict(
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        max_cpu_loras=4,
        lora_target_modules=["q_proj", "v_proj"],
        max_model_len=256,
        dtype="float32",
    )
    assert launch.options == kwargs  # only the flags that were given, and nothing server-side
    cli = launch.build_config()
    assert_same_config(cli, py_config(model, **kwargs))
    lora = cli.stage_by_id(0).lora_config
    assert (lora.max_lora_rank, lora.max_loras, lora.max_cpu_loras) == (16, 2, 4)
    assert settings.port == 9001 and settings.served_model_names == ["tiny"]
    assert settings.lora_modules == [("a", str(tiny_llm_assets.adapter_a))]


def test_without_flags_the_stage_gets_defaults_only(tiny_llm_assets):
    model = str(tiny_llm_assets.model_dir)
    launch, _ = parse_serve_argv([model])
    assert launch.options == {}
    cli = launch.build_config()
    assert_same_config(cli, py_config(model))
    assert cli.stage_by_id(0).lora_config is None


def test_stage_overrides_on_a_multi_stage_pipeline(tiny_llm_assets):
    model = str(tiny_llm_assets.model_dir)
    overrides = {"0": {"enable_lora": True, "max_lora_rank": 64, "max_loras": 2}}
    launch, _ = parse_serve_argv(
        [
            model,
            "--pipeline",
            "llm_chain",
            "--stage-overrides",
            json.dumps(overrides),
            "--max-model-len",
            "256",
        ]
    )
    cli = launch.build_config()
    assert_same_config(cli, py_config(model, "llm_chain", stage_overrides=overrides, max_model_len=256))
    assert cli.stage_by_id(0).lora_config.max_lora_rank == 64
    assert cli.stage_by_id(1).lora_config is None


def test_deploy_yaml_with_cli_precedence(tiny_llm_assets, tmp_path):
    model = str(tiny_llm_assets.model_dir)
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        "pipeline: llm_chain\n"
        "stages:\n"
        "  - stage_id: 0\n    enable_lora: true\n    max_lora_rank: 32\n    max_model_len: 128\n"
        "  - stage_id: 1\n    engine_extras: {max_model_len: 128}\n"
    )
    launch, _ = parse_serve_argv(
        [model, "--deploy-config", str(deploy), "--stage-overrides", '{"0": {"max_lora_rank": 16}}']
    )
    cli = launch.build_config()
    py = py_config(model, None, str(deploy), stage_overrides={"0": {"max_lora_rank": 16}})
    assert_same_config(cli, py)
    assert cli.pipeline.name == "llm_chain"
    assert cli.stage_by_id(0).lora_config.max_lora_rank == 16  # CLI over YAML
    assert cli.stage_by_id(1).options["max_model_len"] == 128


def test_diffusion_lora_flags(tiny_z_image_dir, tmp_path):
    model = str(tiny_z_image_dir)
    adapters = [os.path.realpath(tmp_path / n) for n in ("a.safetensors", "b.safetensors")]
    import torch
    from safetensors.torch import save_file

    for path in adapters:  # start-up adapters must exist with a safetensors header (the tensors load later)
        save_file({"layers.0.attention.to_q.lora_A.weight": torch.zeros(2, 8)}, path)
    launch, _ = parse_serve_argv(
        [model, "--lora-path", adapters[0], "--lora-scale", "0.5", "--max-loras", "2", "--max-cpu-loras", "3"]
        + ["--dtype", "float32"]
    )
    kwargs = dict(lora_path=adapters[0], lora_scale=0.5, max_loras=2, max_cpu_loras=3, dtype="float32")
    assert launch.options == kwargs
    assert_same_config(launch.build_config(), py_config(model, **kwargs))
    launch, _ = parse_serve_argv([model, "--lora-backend", "distill", "--lora-path", *adapters])
    cfg = launch.build_config()
    assert_same_config(cfg, py_config(model, lora_backend="distill", lora_path=adapters))
    assert cfg.stage_by_id(0).options["lora_path"] == adapters


def test_global_max_cpu_loras_next_to_a_diffusion_stage(tiny_llm_assets):
    model = str(tiny_llm_assets.model_dir)
    overrides = '{"0": {"enable_lora": true, "max_cpu_loras": 2}}'
    launch, _ = parse_serve_argv(
        [model, "--pipeline", "llm_to_diffusion", "--max-cpu-loras", "4"] + ["--stage-overrides", overrides]
    )
    cli = launch.build_config()
    py = py_config(model, "llm_to_diffusion", max_cpu_loras=4, stage_overrides=json.loads(overrides))
    assert_same_config(cli, py)
    assert cli.stage_by_id(1).options["max_cpu_loras"] == 4
    assert cli.stage_by_id(0).lora_config.max_cpu_loras == 2


def run_main(argv, monkeypatch, capsys):
    """Run ``vllm-omni serve``; the server must never start (errors come first)."""

    def no_server(*_a, **_k):
        raise AssertionError("the server was started")

    monkeypatch.setattr("vllm_omni.entrypoints.openai.api_server.run_server", no_server)
    with pytest.raises(SystemExit) as info:
        cli_main.main(["serve", *argv])
    return info.value.code, capsys.readouterr().err


def python_error(*args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        py_config(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    "flags, kwargs",
    [
        (
            ["--pipeline", "llm_chain", "--enable-lora", "--max-lora-rank", "64"],
            {"enable_lora": True, "max_lora_rank": 64},
        ),
        (["--pipeline", "llm_chain", "--stage-overrides", "[1]"], {"stage_overrides": "[1]"}),
        (["--pipeline", "llm_chain", "--stage-overrides", '{"5": {}}'], {"stage_overrides": '{"5": {}}'}),
        (
            ["--stage-overrides", '{"0": {"enable_loar": true}}'],
            {"stage_overrides": '{"0": {"enable_loar": true}}'},
        ),
        (["--stage-overrides", "{bad json"], {"stage_overrides": "{bad json"}),
        (["--pipeline", "no_such_pipeline"], {}),
    ],
)
def test_cli_errors_are_the_python_errors(tiny_llm_assets, monkeypatch, capsys, tmp_path, flags, kwargs):
    """The same resolution fails the same way; only the inputs are named with their CLI spelling.
    (A cold command-line cache: with a warm one a misspelled override key is refused before vLLM is
    imported, tests/entrypoints/test_startup_checks.py.)"""
    monkeypatch.setenv("VLLM_OMNI_CACHE_ROOT", str(tmp_path))
    model = str(tiny_llm_assets.model_dir)
    code, err = run_main([model, "--omni", *flags], monkeypatch, capsys)
    pipeline = flags[flags.index("--pipeline") + 1] if "--pipeline" in flags else None
    assert code == 2
    assert python_error(model, pipeline, input_names=CLI_INPUT_NAMES, **kwargs) in err
    assert "keyword argument" not in err  # the Python spelling


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--stage-overrides", '{"0": {"enable_loar": true}}'],
            "--stage-overrides, stage 0 (llm_ar): unknown option 'enable_loar' (did you mean 'enable_lora'?)",
        ),
        (
            ["--stage-overrides", '{"0": {"enable_lora": true, "max_lora_rank": 63}}'],
            "--stage-overrides, stage 0 (llm_ar): max_lora_rank=63: Input should be 1, 8, 16",
        ),
        (
            ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"],
            "--max-cpu-loras and --max-loras, stage 0 (llm_ar): invalid LoRA option(s) "
            "['max_cpu_loras', 'max_loras']: max_cpu_loras (1) must be >= max_loras (2)",
        ),
        (
            ["--pipeline", "llm_chain", "--enable-lora"],
            "--enable-lora: global vLLM LoRA option(s) ['enable_lora'] are ambiguous",
        ),
    ],
)
def test_cli_errors_name_the_flag_and_stage(tiny_llm_assets, monkeypatch, capsys, tmp_path, flags, message):
    monkeypatch.setenv("VLLM_OMNI_CACHE_ROOT", str(tmp_path))  # cold: the typed config's message
    code, err = run_main([str(tiny_llm_assets.model_dir), *flags], monkeypatch, capsys)
    assert code == 2 and f"vllm-omni serve: error: {message}" in err


def test_distill_without_lora_path_fails_before_loading(tiny_z_image_dir, monkeypatch, capsys):
    def no_config(*_a, **_k):
        raise AssertionError("config resolution should not be reached")

    monkeypatch.setattr("vllm_omni.entrypoints.launch.OmniLaunch.build_config", no_config)
    code, err = run_main([str(tiny_z_image_dir), "--lora-backend", "distill"], monkeypatch, capsys)
    assert code == 2 and "--lora-path" in err and "distill" in err


def test_unknown_flag_and_bad_lora_dirs(tiny_llm_assets, monkeypatch, capsys, tmp_path):
    model = str(tiny_llm_assets.model_dir)
    code, err = run_main([model, "--enable-loar"], monkeypatch, capsys)
    assert code == 2 and "--enable-loar" in err
    code, err = run_main([model, "--lora-dirs", str(tmp_path / "missing")], monkeypatch, capsys)
    assert code == 2 and "--lora-dirs" in err


def test_shutdown_timeout_is_a_server_setting(tiny_llm_assets, monkeypatch, capsys):
    model = str(tiny_llm_assets.model_dir)
    launch, settings = parse_serve_argv([model])
    assert settings.shutdown_timeout == 5.0  # a few seconds by default (vLLM's 0 aborts at once)
    launch, settings = parse_serve_argv([model, "--shutdown-timeout", "2.5"])
    assert settings.shutdown_timeout == 2.5 and "shutdown_timeout" not in launch.options
    code, err = run_main([model, "--shutdown-timeout", "-1"], monkeypatch, capsys)
    assert code == 2 and "--shutdown-timeout" in err


def test_vllm_cli_hands_omni_argv_over(tiny_z_image_dir):
    """`vllm serve <model> --omni ...` runs our CLI (vLLM's own dispatch), errors included."""
    cmd = console_script("vllm") + ["serve", str(tiny_z_image_dir), "--omni", "--lora-backend", "distill"]
    cmd += ["--port", "0"]  # the refusal must not depend on whether port 8000 is free
    out = preload.run(cmd, capture_output=True, text=True, env=server_env(), timeout=900)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "vllm-omni serve: error:" in out.stderr and "--lora-path" in out.stderr


def test_serve_starts_the_config_it_resolved(tiny_llm_assets, monkeypatch):
    """`vllm serve` resolves the config once; the server's engines start from that very object."""
    import vllm_omni.entrypoints.omni_base as omni_base
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    built, started = [], []
    real_build = omni_base.build_omni_config

    def counting_build(*args, **kwargs):
        built.append(real_build(*args, **kwargs))
        return built[-1]

    class Started(Exception):
        pass

    def no_engines(cls, config):
        started.append(config)
        raise Started

    monkeypatch.setattr(omni_base, "build_omni_config", counting_build)
    monkeypatch.setattr(AsyncOmni, "from_config", classmethod(no_engines))
    with pytest.raises(Started):
        cli_main.main(["serve", str(tiny_llm_assets.model_dir), "--max-model-len", "128", "--port", "0"])
    assert len(built) == 1 and started == built
    assert started[0].entry_stage.options["max_model_len"] == 128


@pytest.mark.parametrize("warm", [False, True])
def test_unknown_flags_get_a_suggestion(tiny_llm_assets, monkeypatch, capsys, tmp_path, warm):
    """The full parser (cold cache) and the cached answer (warm) say the same thing."""
    monkeypatch.setenv("VLLM_OMNI_CACHE_ROOT", str(tmp_path))
    argv = [str(tiny_llm_assets.model_dir), "--max-model-len", "64", "--enable-loar", "--max_lora_rnak=8"]
    if warm:
        run_main([str(tiny_llm_assets.model_dir), "--no-such-flag"], monkeypatch, capsys)  # fills the cache
        assert list(tmp_path.glob("cli-*.json"))
    code, err = run_main(argv, monkeypatch, capsys)
    assert code == 2
    assert (
        "vllm-omni serve: error: unknown option '--enable-loar' (did you mean '--enable-lora'?); "
        "unknown option '--max-lora-rnak' (did you mean '--max-lora-rank'?)"
    ) in err
    # abbreviations are not accepted (the cached answer could not know them)
    code, err = run_main([str(tiny_llm_assets.model_dir), "--enable-lor"], monkeypatch, capsys)
    assert code == 2 and "unknown option '--enable-lor' (did you mean '--enable-lora'?)" in err
    if warm:  # a typo is reported before the address is bound (a busy port would hide it)
        import socket

        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = str(busy.getsockname()[1])
            code, err = run_main(argv + ["--host", "127.0.0.1", "--port", port], monkeypatch, capsys)
        assert code == 2 and "unknown option '--enable-loar'" in err and "already in use" not in err
        # the fast path holds the address; a refusal by the full parser lets it go (no leak in-process)
        from vllm_omni.entrypoints.cli import preflight

        code, err = run_main(
            [
                str(tiny_llm_assets.model_dir),
                "--lora-backend",
                "distill",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ],
            monkeypatch,
            capsys,
        )
        assert code == 2 and "--lora-path" in err and preflight._held == {}


def test_help_and_unknown_flags_answer_without_vllm(tiny_llm_assets, monkeypatch, capsys, tmp_path):
    """With a warm cache, --help and flag errors import neither vLLM nor torch."""
    monkeypatch.setenv("VLLM_OMNI_CACHE_ROOT", str(tmp_path))
    with pytest.raises(SystemExit):
        cli_main.main(["serve", "--help"])  # builds the full parser and the cache
    full_help = capsys.readouterr().out
    probe = (
        "import sys, time\n"
        "from vllm_omni.entrypoints.cli.main import main\n"
        "t = time.perf_counter()\n"
        "for argv in (['serve', '--help'], ['serve', 'm', '--enable-loar']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        print('exit', e.code, file=sys.stderr)\n"
        "print('seconds', time.perf_counter() - t, 'vllm' in sys.modules, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    env = server_env(VLLM_OMNI_CACHE_ROOT=str(tmp_path), COLUMNS=os.environ.get("COLUMNS", ""))
    import sys

    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=900)
    assert out.stdout == full_help
    assert "exit 0" in out.stderr and "exit 2" in out.stderr
    assert "unknown option '--enable-loar' (did you mean '--enable-lora'?)" in out.stderr
    _, vllm_loaded, torch_loaded = out.stderr.split("seconds ")[1].split()
    assert (vllm_loaded, torch_loaded) == ("False", "False")  # how fast: benchmarks/startup_checks.py


def test_diffusion_enforce_eager_flags(tiny_z_image_dir):
    """vLLM's ``--enforce-eager`` / ``--no-enforce-eager`` reach a diffusion stage; unset means by device."""
    from vllm_omni.config.diffusion import OmniDiffusionConfig

    model = str(tiny_z_image_dir)
    for flag, value in (("--enforce-eager", True), ("--no-enforce-eager", False)):
        launch, _ = parse_serve_argv([model, flag])
        assert launch.options == {"enforce_eager": value}
        cfg = launch.build_config()
        assert_same_config(cfg, py_config(model, enforce_eager=value))
        assert cfg.stage_by_id(0).options["enforce_eager"] is value
    launch, _ = parse_serve_argv([model])
    assert "enforce_eager" not in launch.options
    assert OmniDiffusionConfig(device="cpu").compiles is False
    assert OmniDiffusionConfig(device="cpu", enforce_eager=False).compiles is True
    assert OmniDiffusionConfig(device="cuda", enforce_eager=True).compiles is False
    assert OmniDiffusionConfig(device="cuda").compiles is True


def test_a_start_up_adapter_refused_once_loaded_is_one_error_line(tiny_llm_assets, monkeypatch, capsys):
    """What only the loaded stage can refuse (a rank above --max-lora-rank) ends ``serve`` as the
    checks before loading do: ``vllm-omni serve: error: ...`` on one line, exit 2, no traceback."""
    from vllm_omni.entrypoints.cli import preflight
    from vllm_omni.errors import ConfigError

    def refused(config, settings, listener=None):
        listener.close()
        raise ConfigError("--lora-modules big=/x/big: rank 64 exceeds max_lora_rank=16")

    monkeypatch.setattr("vllm_omni.entrypoints.openai.api_server.run_server", refused)
    with pytest.raises(SystemExit) as info:
        cli_main.main(["serve", str(tiny_llm_assets.model_dir), "--host", "127.0.0.1", "--port", "0"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and preflight._held == {}
    assert err.endswith(
        "vllm-omni serve: error: --lora-modules big=/x/big: rank 64 exceeds max_lora_rank=16\n"
    )
    assert "Traceback" not in err
