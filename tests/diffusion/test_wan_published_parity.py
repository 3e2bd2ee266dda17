"""The in-tree Wan pipeline on tiny folders built from the PUBLISHED Wan configs (``UniPCMultistepScheduler``
with flow sigmas: int64 timesteps) equals diffusers' ``WanPipeline`` on the same weights, float32.

Regression for issue 45: ``timestep_sinusoid`` cast its frequencies to the timestep's dtype, so int64
timesteps truncated every frequency but the first to 0 (0.35 away on Wan2.2-T2V-A14B before the fix).
Wan2.2-T2V-A14B (two experts, ``boundary_ratio`` 0.875) and Wan2.1-T2V (one denoiser, ``flow_shift`` 3 and 5),
``expand_timesteps`` false; norm weights away from 1/0 (``tools/make_tiny_dit.py``); 32x48, 5 frames, CFG on.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni.diffusion.models.wan.spec import PUBLISHED

pytestmark = [pytest.mark.slow]
TOL = 1e-4
CHECKPOINTS = {c.name: c for c in PUBLISHED}
NAMES = ["Wan2.2-T2V-A14B-Diffusers", "Wan2.1-T2V-1.3B-Diffusers", "Wan2.1-T2V-14B-Diffusers"]
CALL = {"height": 32, "width": 48, "num_frames": 5, "guidance_scale": 4.0}
PROMPTS = ["a red cat on the mat", "a dog"]


def _folder(name: str):
    from tests.conftest import test_assets_root
    from tools.make_tiny_dit import ensure_tiny_published

    return ensure_tiny_published(test_assets_root(), CHECKPOINTS[name], "wan")


def _in_tree(folder, steps: int) -> torch.Tensor:
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
    from vllm_omni.diffusion.pipelines.wan import WanPipeline
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    init_diffusion_parallel_state(1, 0)
    config = OmniDiffusionConfig(model=str(folder), dtype="float32", device="cpu", enable_progress_bar=False)
    pipe = WanPipeline(config)
    sp = OmniDiffusionSamplingParams(
        height=CALL["height"],
        width=CALL["width"],
        guidance_scale=CALL["guidance_scale"],
        num_inference_steps=steps,
        negative_prompt="blurry",
        output_type="latent",
        extra_args={"num_frames": CALL["num_frames"]},
    )
    outs = pipe.generate(PROMPTS, sp, seeds=[7, 8])
    return torch.cat([torch.as_tensor(o.latents) for o in outs])


def _diffusers(folder, steps: int) -> torch.Tensor:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    gens = [torch.Generator().manual_seed(s) for s in (7, 8)]
    out = pipe(
        prompt=PROMPTS,
        negative_prompt="blurry",
        num_inference_steps=steps,
        generator=gens,
        output_type="latent",
        **CALL,
    ).frames
    return out.float()


@pytest.mark.parametrize("name", NAMES)
def test_published_wan_latents_equal_diffusers(name):
    folder = _folder(name)
    scheduler = CHECKPOINTS[name].scheduler
    assert scheduler["_class_name"] == "UniPCMultistepScheduler" and scheduler["use_flow_sigmas"]
    for steps in (4, 1) if "A14B" in name else (3,):
        got, want = _in_tree(folder, steps), _diffusers(folder, steps)
        err = (got - want).abs().max().item()
        print(f"{name} steps={steps}: max |in-tree - diffusers| = {err:.3g}")
        assert err <= TOL, f"{name}, {steps} steps: {err}"
