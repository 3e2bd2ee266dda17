"""Schedules and results that are not finite are refused, never answered with a black image (issue 45).

Qwen-Image's published scheduler has ``shift_terminal`` 0.02: at one step diffusers' ``stretch_shift_to_terminal``
divides 0 by 0 and ``QwenImagePipeline`` returns NaN latents. The in-tree pipeline refuses that request
before any denoiser call, naming ``num_inference_steps`` and ``shift_terminal``; at two steps it equals
diffusers. Latents that end non-finite for another cause are refused after the loop.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

SIZE = {"height": 32, "width": 48}


def _with_terminal(scheduler):
    return type(scheduler).from_config(scheduler.config, shift_terminal=0.02)


@pytest.fixture(scope="module")
def pipes(tiny_qwen_image_dir):
    from diffusers import QwenImagePipeline

    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
    from vllm_omni.diffusion.pipelines.qwen_image import QwenImagePipeline as InTree

    init_diffusion_parallel_state(1, 0)
    config = OmniDiffusionConfig(
        model=str(tiny_qwen_image_dir), dtype="float32", device="cpu", enable_progress_bar=False
    )
    ours = InTree(config)
    ours.scheduler = _with_terminal(ours.scheduler)
    ref = QwenImagePipeline.from_pretrained(str(tiny_qwen_image_dir))
    ref.scheduler = _with_terminal(ref.scheduler)
    ref.set_progress_bar_config(disable=True)
    return ours, ref


def _ref(ref, steps: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return ref("a cat", num_inference_steps=steps, generator=gen, output_type="latent", **SIZE).images


def test_one_step_with_shift_terminal_is_refused_naming_the_fields(pipes):
    ours, ref = pipes
    assert torch.isnan(_ref(ref, 1)).all()  # what diffusers answers: NaN latents
    sp = OmniDiffusionSamplingParams(num_inference_steps=1, seed=3, output_type="latent", **SIZE)
    calls = []
    ours.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(InvalidRequestError, match=r"num_inference_steps=1 .*shift_terminal=0\.02"):
        ours.generate(["a cat"], sp)
    assert not calls  # refused before the denoiser ran
    sp2 = OmniDiffusionSamplingParams(num_inference_steps=2, seed=3, output_type="latent", **SIZE)
    [out] = ours.generate(["a cat"], sp2)
    assert (torch.as_tensor(out.latents) - _ref(ref, 2)).abs().max() <= 1e-4


def test_non_finite_latents_after_the_loop_are_refused():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from vllm_omni.diffusion.pipelines.denoise import prepare_scheduler, run_denoising_loop

    def scheduler():
        return prepare_scheduler(FlowMatchEulerDiscreteScheduler(), "cpu", steps=2)

    latents = torch.zeros(1, 4)
    with pytest.raises(InvalidRequestError, match=r"non-finite latents .*guidance_scale"):
        run_denoising_loop(scheduler(), latents, lambda i, t, x: torch.full_like(x, float("inf")), _null())
    out = run_denoising_loop(scheduler(), latents, lambda i, t, x: torch.ones_like(x), _null())
    assert torch.isfinite(out).all()


def _null():
    import contextlib

    return contextlib.nullcontext()
