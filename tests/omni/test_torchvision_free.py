"""vLLM's Qwen2-VL import path without torchvision (vllm_omni.models.torchvision_free)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_omni.errors import ConfigError
from vllm_omni.models import torchvision_free

PROBE = """
import importlib, importlib.util, sys
assert importlib.util.find_spec("torchvision") is None, "this check needs a machine without torchvision"
try:
    importlib.import_module("vllm.model_executor.models.qwen2_5_omni_thinker")
except ModuleNotFoundError as exc:
    print("plain import fails:", exc.name)
from vllm_omni.models.torchvision_free import ensure_qwen2_vl_importable
assert ensure_qwen2_vl_importable()
import vllm_omni.models.qwen2_5_omni_thinker as m
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as pil
assert smart_resize is pil
print("shimmed import works:", m.Qwen2_5OmniThinkerForConditionalGeneration.__name__)
"""


@pytest.mark.skipif(torchvision_free.torchvision_available(), reason="torchvision is installed: no alias")
def test_thinker_imports_without_torchvision_only_through_the_alias():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "plain import fails: torchvision" in out.stdout
    assert "shimmed import works: Qwen2_5OmniThinkerForConditionalGeneration" in out.stdout


def test_alias_is_not_applied_when_torchvision_is_installed(monkeypatch):
    monkeypatch.setattr(torchvision_free, "torchvision_available", lambda: True)
    monkeypatch.delitem(sys.modules, torchvision_free.TORCHVISION_MODULE, raising=False)
    assert torchvision_free.ensure_qwen2_vl_importable() is False
    assert torchvision_free.TORCHVISION_MODULE not in sys.modules


def test_thinker_takes_audio_not_video_without_torchvision(monkeypatch):
    monkeypatch.setattr(torchvision_free, "torchvision_available", lambda: False)
    kwargs: dict = {}
    assert torchvision_free.video_off_without_torchvision("Stage 0 (llm_ar)", kwargs)
    assert kwargs["limit_mm_per_prompt"] == {"audio": 1, "image": 0, "video": 0}
    kwargs = {"limit_mm_per_prompt": {"audio": 2, "image": 1}}  # image and more audio: allowed
    assert torchvision_free.video_off_without_torchvision("Stage 0 (llm_ar)", kwargs)
    assert kwargs["limit_mm_per_prompt"] == {"audio": 2, "image": 1, "video": 0}
    with pytest.raises(
        ConfigError, match=r"Stage 0 \(llm_ar\): limit_mm_per_prompt \{'video': 1\}.*torchvision"
    ):
        torchvision_free.video_off_without_torchvision(
            "Stage 0 (llm_ar)", {"limit_mm_per_prompt": {"video": 1}}
        )
    kwargs = {"limit_mm_per_prompt": {"audio": 1, "video": {"count": 0}}}  # vLLM's dict form
    assert torchvision_free.video_off_without_torchvision("Stage 0 (llm_ar)", kwargs)
    assert kwargs["limit_mm_per_prompt"] == {"audio": 1, "video": 0}
    monkeypatch.setattr(torchvision_free, "torchvision_available", lambda: True)
    kwargs = {}
    assert not torchvision_free.video_off_without_torchvision("Stage 0 (llm_ar)", kwargs)
    assert kwargs == {}


def test_thinker_stage_engine_args_name_the_class(tiny_omni_assets, monkeypatch):
    from vllm_omni.config import VllmOmniConfig
    from vllm_omni.config.pipeline_registry import resolve_pipeline_config
    from vllm_omni.engine.stage_engine_args import project_stage_engine_kwargs

    monkeypatch.setattr(torchvision_free, "torchvision_available", lambda: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # a fresh shell: the budget is ours
    cfg = VllmOmniConfig.from_pipeline_config(
        resolve_pipeline_config("qwen2_5_omni_thinker_only"),
        {"hf_overrides": {"x": 1}},
        model=str(tiny_omni_assets.model_dir),
    )
    kwargs = project_stage_engine_kwargs(cfg.stage_by_id(0))
    assert kwargs["hf_overrides"] == {
        "x": 1,
        "architectures": ["OmniQwen2_5OmniThinkerForConditionalGeneration"],
    }
    assert kwargs["limit_mm_per_prompt"] == {"audio": 1, "image": 0, "video": 0}
    assert kwargs["mm_processor_cache_gb"] == 0  # a refused request cannot leave the cache out of step
    # sized from the thinker's text config (thinker_config.text_config), not vLLM's 0.92 of all RAM
    assert kwargs["kv_cache_memory_bytes"] >= 256 << 20
