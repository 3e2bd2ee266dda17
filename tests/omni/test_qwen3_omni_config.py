"""Qwen3-Omni and Qwen2.5-Omni folders get their Omni pipeline from ``config.json`` (no engine starts)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import test_assets_root

THINKER_ARCH = "OmniQwen3OmniMoeThinkerForConditionalGeneration"


@pytest.fixture(scope="module")
def assets():
    from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets

    return ensure_tiny_qwen3_omni_assets(test_assets_root())


@pytest.mark.parametrize(
    ("arch", "audio", "expected"),
    [
        ("Qwen3OmniMoeForConditionalGeneration", None, "qwen3_omni"),
        ("Qwen3OmniMoeForConditionalGeneration", False, "qwen3_omni_thinker_only"),
        ("Qwen2_5OmniForConditionalGeneration", None, "qwen2_5_omni"),
        ("Qwen2_5OmniForConditionalGeneration", False, "qwen2_5_omni_thinker_only"),
    ],
)
def test_pipeline_is_picked_from_config_json(tmp_path, arch, audio, expected):
    from vllm_omni.config.pipeline_registry import pipeline_for_model, resolve_pipeline_config

    cfg = {"architectures": [arch]} | ({} if audio is None else {"enable_audio_output": audio})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert pipeline_for_model(str(tmp_path)) == resolve_pipeline_config(expected)


def test_serve_picks_the_pipeline_from_config_json(assets, monkeypatch, capsys):
    """``vllm-omni serve <folder>`` resolves what ``Omni(<folder>)`` does (``--dry-run``: nothing starts)."""
    from vllm_omni.entrypoints.cli import main as cli_main

    def no_server(*_a, **_k):
        raise AssertionError("the server was started")

    monkeypatch.setattr("vllm_omni.entrypoints.openai.api_server.run_server", no_server)
    cli_main.main(["serve", str(assets.model_dir), "--dry-run"])
    described = json.loads(capsys.readouterr().out)
    assert described["pipeline"] == "qwen3_omni"
    assert [s["model_arch"] for s in described["stages"]] == [
        THINKER_ARCH,
        "OmniQwen3OmniMoeTalkerForConditionalGeneration",
        "OmniQwen3OmniMoeCode2Wav",
    ]
