"""Every stage runtime describes itself (``StageRuntime.describe``), and the worker proxy reports
its worker's description unchanged.

What each kind says is checked against what the model and the options make of it: the context
vLLM resolved, the LoRA limits, the pipeline's own call signature (an input image, video
frames), the denoisers adapters bind to. The talker and code2wav are checked with their pipeline
(``tests/omni/test_qwen2_5_omni_audio.py``), Ray actors in ``tests/engine/workers/test_ray_backend.py``.
"""

from __future__ import annotations

import json

import pytest
from vllm import SamplingParams

from vllm_omni.entrypoints.omni_base import build_omni_config
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def diffusion_assets():
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return ensure_tiny_diffusion_assets(test_assets_root())


def _stage(model, **options):
    return build_omni_config(str(model), dtype="float32", enable_progress_bar=False, **options).stages[0]


def test_llm_stage_describes_text_and_its_engines_limits(tiny_llm_assets):
    from vllm_omni.engine.llm_stage import LLMStageEngine

    config = build_omni_config(
        str(tiny_llm_assets.model_dir), max_model_len=192, enable_lora=True, max_loras=2, max_lora_rank=16
    )
    runtime = LLMStageEngine(config.stages[0])
    try:
        d = runtime.describe()
    finally:
        runtime.shutdown(30)
    assert (d.stage_id, d.label, d.output_kind) == (0, "Stage 0 (llm_ar)", "text")
    assert d.inputs == {"text", "token_ids"} and d.params_type is SamplingParams
    assert d.max_model_len == 192 and d.voices == () and d.max_batch_size is None
    assert (d.adapters.kind, d.adapters.max_loras, d.adapters.max_per_request) == ("llm", 2, 1)
    assert d.adapters.max_lora_rank == 16


def test_in_tree_diffusion_stage_describes_images_from_text(diffusion_assets):
    from vllm_omni.engine.diffusion_stage import DiffusionStageEngine

    runtime = DiffusionStageEngine(_stage(diffusion_assets["z_image"], max_loras=2, max_batch_size=3))
    try:
        d = runtime.describe()
        assert d.size_multiple == runtime.size_factor and d.max_image_size == runtime.max_size
    finally:
        runtime.shutdown(30)
    assert d.output_kind == "image" and d.inputs == {"text"} and d.params_type is OmniDiffusionSamplingParams
    assert d.max_batch_size == 3 and d.max_model_len is None
    assert (d.adapters.kind, d.adapters.max_loras, d.adapters.max_per_request) == ("diffusion", 2, 2)
    assert d.adapters.denoisers == ("transformer",) and d.adapters.startup_adapters == ()


def test_an_image_to_image_diffusers_pipeline_describes_an_image_input(diffusion_assets, tmp_path):
    """The same tiny SD3 components as text-to-image and as img2img: only the pipeline's call differs."""
    from vllm_omni.engine.diffusion_stage import DiffusionStageEngine

    sd3 = diffusion_assets["sd3"]
    img2img = tmp_path / "sd3_img2img"
    img2img.mkdir()
    for child in sd3.iterdir():
        if child.is_dir():
            (img2img / child.name).symlink_to(child, target_is_directory=True)
    index = json.loads((sd3 / "model_index.json").read_text())
    (img2img / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "StableDiffusion3Img2ImgPipeline"})
    )
    kinds = {}
    for name, model in (("t2i", sd3), ("i2i", img2img)):
        runtime = DiffusionStageEngine(_stage(model))
        try:
            kinds[name] = runtime.describe()
        finally:
            runtime.shutdown(30)
    assert kinds["t2i"].output_kind == kinds["i2i"].output_kind == "image"
    assert kinds["t2i"].inputs == {"text"} and kinds["i2i"].inputs == {"text", "image"}


def test_a_video_pipeline_describes_video():
    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan
    from vllm_omni.engine.diffusion_stage import DiffusionStageEngine

    runtime = DiffusionStageEngine(_stage(ensure_tiny_wan(test_assets_root())))
    try:
        d = runtime.describe()
    finally:
        runtime.shutdown(30)
    assert d.output_kind == "video" and d.adapters.kind == "diffusion"


def test_the_mp_worker_proxy_reports_its_workers_description(diffusion_assets):
    from vllm_omni.engine.inline_runtime import make_inline_runtime
    from vllm_omni.engine.workers.client import WorkerStageRuntime

    stage = _stage(diffusion_assets["z_image"], max_loras=2)
    proxy = WorkerStageRuntime(stage)
    try:
        remote = proxy.describe()
        assert proxy.describe() is remote  # asked once
    finally:
        proxy.shutdown(30)
    inline = make_inline_runtime(stage)
    try:
        assert remote == inline.describe()
    finally:
        inline.shutdown(30)
