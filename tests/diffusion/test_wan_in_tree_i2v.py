"""The in-tree ``WanImageToVideoPipeline`` against diffusers' ``WanImageToVideoPipeline`` on the same tiny weights
(float32, final latents within 1e-4): Wan2.2 A14B-style (two experts, no image encoder) through ``Omni``
with first frame, first + last frame and the ``[high, low]`` adapter pair; Wan2.1-style (one expert, a CLIP
image encoder feeding image cross-attention) on the pipeline itself. Both directories come from
``tools/make_tiny_wan.py --i2v``.

diffusers 0.42.1's ``pipeline_wan_i2v.basic_clean`` calls ``ftfy`` without checking that it is installed
(``pipeline_wan.py`` checks); it is not installed here, so the reference gets an identity ``fix_text``
(what ftfy does to these ASCII prompts).
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.diffusion.test_wan_moe_distill import GEN, NUM_FRAMES, PROMPT, SEED, _write_adapter
from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.request import LoRARequest

pytestmark = [pytest.mark.slow]
TOL = 1e-4


def _image(seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(40, 56, 3) * 255).astype("uint8"))


def i2v_reference_class():
    """diffusers' ``WanImageToVideoPipeline``, its missing ``ftfy`` replaced by an identity (module docstring)."""
    import diffusers.pipelines.wan.pipeline_wan_i2v as module

    if not hasattr(module, "ftfy"):
        module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)
    return module.WanImageToVideoPipeline


def _reference(model_dir: Path, image, last_image=None, loras: tuple[str, ...] = ()) -> torch.Tensor:
    pipe = i2v_reference_class().from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    for i, path in enumerate(loras):
        pipe.load_lora_weights(path, adapter_name=f"a{i}", load_into_transformer_2=i == 1)
    gen = [torch.Generator().manual_seed(SEED)]
    return pipe(
        image=image,
        last_image=last_image,
        prompt=[PROMPT],
        num_frames=NUM_FRAMES,
        output_type="latent",
        generator=gen,
        **GEN,
    ).frames.float()


def _sp(**extra):
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return OmniDiffusionSamplingParams(
        seed=SEED, output_type="latent", extra_args={"num_frames": NUM_FRAMES, **extra}, **GEN
    )


def _err(a, b) -> float:
    return float((torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs().max())


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan

    return ensure_tiny_wan(test_assets_root(), moe=True, i2v=True)


def test_two_experts_first_and_last_frame_and_the_pair_match_diffusers(moe_dir, tmp_path):
    from vllm_omni import Omni
    from vllm_omni.diffusion.models.wan.pipeline_i2v import WanImageToVideoPipeline

    high = os.fspath(_write_adapter(moe_dir, "transformer", 10, tmp_path / "high"))
    low = os.fspath(_write_adapter(moe_dir, "transformer_2", 11, tmp_path / "low"))
    first, last = _image(0), _image(1)
    pair = [LoRARequest("high", 1, high), LoRARequest("low", 2, low)]
    with Omni(str(moe_dir), max_loras=2, dtype="float32", enable_progress_bar=False) as omni:
        stage = omni._orchestrator.runtimes[0]
        assert isinstance(stage._engine.pipeline, WanImageToVideoPipeline)
        assert stage.describe().inputs == {"text", "image"}
        got = {
            "first": omni.generate([PROMPT], _sp(image=first), use_tqdm=False)[0].latents,
            "both": omni.generate([PROMPT], _sp(image=first, last_image=last), use_tqdm=False)[0].latents,
            "pair": omni.generate([PROMPT], _sp(image=first), lora_requests=pair, use_tqdm=False)[0].latents,
        }
        with pytest.raises(InvalidRequestError, match=r"needs an input image: pass extra_args\['image'\]"):
            omni.generate([PROMPT], _sp(), use_tqdm=False)
    want_first = _reference(moe_dir, first)
    assert _err(got["first"], want_first) <= TOL
    assert _err(got["both"], _reference(moe_dir, first, last)) <= TOL
    want_pair = _reference(moe_dir, first, loras=(high, low))
    assert _err(want_pair, want_first) > 0.02  # the adapters matter
    assert _err(got["pair"], want_pair) <= TOL


def test_clip_image_encoder_and_image_cross_attention_match_diffusers():
    """Wan2.1-style I2V: CLIP ``hidden_states[-2]`` of the image feed ``add_k_proj`` / ``add_v_proj``."""
    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
    from vllm_omni.diffusion.models.wan.pipeline_i2v import WanImageToVideoPipeline

    model_dir = ensure_tiny_wan(test_assets_root(), i2v=True)
    init_diffusion_parallel_state(1, 0)
    config = OmniDiffusionConfig(
        model=str(model_dir), dtype="float32", device="cpu", enable_progress_bar=False
    )
    pipe = WanImageToVideoPipeline(config)
    assert pipe.image_encoder is not None and pipe.transformer.accepts_image_embeds
    [out] = pipe.generate([PROMPT], _sp(image=_image(0)))
    assert _err(out.latents, _reference(model_dir, _image(0))) <= TOL
