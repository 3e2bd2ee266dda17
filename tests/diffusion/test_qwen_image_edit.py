"""In-tree Qwen-Image edit against diffusers' QwenImageEditPipeline on the same tiny weights (fp32).

diffusers resizes the input image to about 1024 x 1024 pixels (``calculate_dimensions(1024 * 1024, ...)``,
hard-coded): far too slow for a tiny CPU test, so both sides are run at 64 x 64 pixels instead, diffusers
through its module's ``calculate_dimensions`` and ours through ``condition_area``. The processor is
transformers' Qwen2-VL processor without its video part (no torchvision here), on both sides.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest

TOL = 1e-4
AREA = 64 * 64
PROMPT = "make the cat blue"
IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8))


def params(**overrides) -> OmniDiffusionSamplingParams:
    base = dict(
        num_inference_steps=2, guidance_scale=4.0, negative_prompt="blurry", seed=1, output_type="latent"
    )
    base.update(overrides)
    base.setdefault("extra_args", {"image": IMAGE})
    return OmniDiffusionSamplingParams(**base)


@pytest.fixture(scope="module")
def engine(tiny_qwen_image_edit_dir):
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    config = OmniDiffusionConfig(
        model=str(tiny_qwen_image_edit_dir),
        dtype="float32",
        device="cpu",
        enable_progress_bar=False,
        max_loras=1,
    )
    engine = DiffusionEngine(config)
    assert type(engine.pipeline).__name__ == "QwenImageEditPipeline" and engine.pipeline.accepts_image
    engine.pipeline.condition_area = AREA
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_qwen_image_edit_dir):
    from diffusers import QwenImageEditPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as module

    from vllm_omni.models.torchvision_free import load_qwen2_vl_processor

    original = module.calculate_dimensions
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "calculate_dimensions", lambda _area, ratio: original(AREA, ratio))
        processor = load_qwen2_vl_processor(str(tiny_qwen_image_edit_dir / "processor"))
        pipe = QwenImageEditPipeline.from_pretrained(str(tiny_qwen_image_edit_dir), processor=processor)
        pipe.set_progress_bar_config(disable=True)

        @torch.no_grad()
        def run(negative="blurry", **kw):
            return pipe(
                IMAGE,
                PROMPT,
                negative_prompt=negative,
                true_cfg_scale=4.0,
                num_inference_steps=2,
                generator=torch.Generator().manual_seed(1),
                output_type="latent",
                **kw,
            ).images

        yield pipe, run


@pytest.mark.parametrize(
    ("negative", "size"),
    [("blurry", {"height": 32, "width": 48}), (None, {})],
    ids=["cfg-32x48", "default-size"],
)
def test_edit_matches_diffusers(engine, reference, negative, size):
    _, run = reference
    [out] = engine.generate([PROMPT], params(negative_prompt=negative, **size))
    expected = run(negative, **size)
    assert out.latents.shape == expected.shape
    assert (out.latents - expected).abs().max().item() <= TOL


def test_edit_with_a_kohya_adapter_matches_diffusers(engine, reference, tiny_qwen_image_loras):
    pipe, run = reference
    path = tiny_qwen_image_loras["attn_kohya"]
    base = run()
    pipe.load_lora_weights(str(path), adapter_name="k")
    pipe.set_adapters(["k"], [0.8])
    try:
        expected = run()
    finally:
        pipe.unload_lora_weights()
    request = LoRARequest("kohya", 1, str(path))
    [out] = engine.generate([PROMPT], params(lora_requests=[request], lora_scales=[0.8]))
    assert (out.latents - expected).abs().max().item() <= TOL
    assert (expected - base).abs().max().item() > 50 * TOL


@pytest.mark.parametrize(
    ("extra_args", "match"),
    [({}, "needs an input image"), ({"image": "cat.png"}, "must be a PIL image")],
    ids=["no-image", "not-an-image"],
)
def test_edit_without_a_usable_image_is_refused(engine, extra_args, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([PROMPT], params(extra_args=extra_args))
