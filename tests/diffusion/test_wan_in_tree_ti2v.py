"""Wan2.2 TI2V-5B image-to-video (``WanImageToVideoPipeline`` with ``expand_timesteps``) on the in-tree pipeline,
which ``pipeline_backend="auto"`` picks, against diffusers' ``WanImageToVideoPipeline`` with peft on the same
tiny weights (``tools/make_tiny_wan.py --ti2v``: 48 latent channels, a Wan2.2-style 16x VAE), float32, same
prompt, seed and image: final latents and decoded frames within 1e-4 without an adapter and with a PEFT file
at scale 0.6 (diffusers: ``load_lora_weights`` + ``set_adapters``). The conditioning: the image is the clean
first latent frame of every step's input and of the result, whose tokens get timestep 0.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.diffusion.test_wan_in_tree_i2v import _err, _image, i2v_reference_class
from tests.diffusion.test_wan_moe_distill import PROMPT, SEED, _write_adapter
from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.request import LoRARequest

pytestmark = [pytest.mark.slow]
TOL = 1e-4
#: sizes are multiples of 32 (the 16x VAE times the 2x2 patch): 3 latent frames of 2 x 2 tokens
GEN = {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 3.0}
NUM_FRAMES = 9
SCALE = 0.6


@pytest.fixture(scope="module")
def ti2v_dir() -> Path:
    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan

    return ensure_tiny_wan(test_assets_root(), ti2v=True)


@pytest.fixture(scope="module")
def adapter(ti2v_dir, tmp_path_factory) -> str:
    return os.fspath(_write_adapter(ti2v_dir, "transformer", 12, tmp_path_factory.mktemp("ti2v") / "a"))


@pytest.fixture(scope="module")
def reference(ti2v_dir, adapter) -> dict[str, torch.Tensor]:
    """diffusers' latents and ``np`` frames without the adapter, and latents with it at ``SCALE``."""
    pipe = i2v_reference_class().from_pretrained(str(ti2v_dir))
    assert pipe.config.expand_timesteps
    pipe.set_progress_bar_config(disable=True)

    def run(output_type: str) -> torch.Tensor:
        gen = [torch.Generator().manual_seed(SEED)]
        call = {"num_frames": NUM_FRAMES, "output_type": output_type, "generator": gen, **GEN}
        return torch.as_tensor(pipe(image=_image(0), prompt=[PROMPT], **call).frames).float()

    out = {"latents": run("latent"), "frames": run("np")}
    pipe.load_lora_weights(adapter, adapter_name="a")
    pipe.set_adapters(["a"], [SCALE])
    out["lora"] = run("latent")
    return out


def _sp(output_type: str = "latent", **extra):
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return OmniDiffusionSamplingParams(
        seed=SEED, output_type=output_type, extra_args={"num_frames": NUM_FRAMES, **extra}, **GEN
    )


def test_ti2v_image_to_video_runs_in_tree_and_matches_diffusers(ti2v_dir, adapter, reference):
    from vllm_omni import Omni
    from vllm_omni.diffusion.pipelines.wan_i2v import WanImageToVideoPipeline

    with Omni(str(ti2v_dir), dtype="float32", enable_progress_bar=False) as omni:
        pipeline = omni._orchestrator.runtimes[0]._engine.pipeline
        assert isinstance(pipeline, WanImageToVideoPipeline) and pipeline.expand_timesteps
        [base] = omni.generate([PROMPT], _sp("np", image=_image(0)), use_tqdm=False)
        lora = LoRARequest("a", 1, adapter)
        [adapted] = omni.generate(
            [PROMPT], _sp(image=_image(0)), lora_requests=[lora], lora_scales=[SCALE], use_tqdm=False
        )
        with pytest.raises(InvalidRequestError, match=r"needs an input image: pass extra_args\['image'\]"):
            omni.generate([PROMPT], _sp(), use_tqdm=False)
        with pytest.raises(InvalidRequestError, match=r"extra_args\['last_image'\] is not used"):
            omni.generate([PROMPT], _sp(image=_image(0), last_image=_image(1)), use_tqdm=False)
    frames = base.stage_outputs[0].array
    assert frames.shape == reference["frames"].shape == (1, NUM_FRAMES, 64, 64, 3)
    assert _err(frames, reference["frames"]) <= TOL
    assert _err(base.latents, reference["latents"]) <= TOL
    assert _err(reference["lora"], reference["latents"]) > 0.02  # the adapter matters at this scale
    assert _err(adapted.latents, reference["lora"]) <= TOL
