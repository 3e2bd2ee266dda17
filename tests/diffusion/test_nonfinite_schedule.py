"""Schedules and results that are not finite are refused, never answered with a black image (issue 45).

Qwen-Image's published scheduler has ``shift_terminal`` 0.02: at one step diffusers' ``stretch_shift_to_terminal``
divides 0 by 0 and ``QwenImagePipeline`` returns NaN latents; a schedule that is not finite is refused before
any encoding or denoiser call (the contract test, ``tests/diffusion/contract``, checks it on the published
Qwen-Image configs). Latents that end non-finite for another cause are refused after the loop.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni.errors import InvalidRequestError


def test_one_step_with_shift_terminal_is_refused_naming_the_fields():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from vllm_omni.diffusion.models.qwen_image.spec import SCHEDULER
    from vllm_omni.diffusion.pipelines.denoise import prepare_scheduler

    published = FlowMatchEulerDiscreteScheduler.from_config(
        {k: v for k, v in SCHEDULER.items() if k[0] != "_"}
    )
    with pytest.raises(InvalidRequestError, match=r"num_inference_steps=1 .*shift_terminal=0\.02"):
        prepare_scheduler(published, "cpu", sigmas=[1.0], mu=0.5)
    assert torch.isfinite(prepare_scheduler(published, "cpu", sigmas=[1.0, 0.5], mu=0.5).sigmas).all()


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
