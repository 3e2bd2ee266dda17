"""Scale schedules through ``Omni`` and ``AsyncOmni`` on the tiny Z-Image, against diffusers + peft.

The oracle is diffusers' ``ZImagePipeline`` with the same PEFT adapters whose ``set_adapters`` weights
change at each step through ``callback_on_step_end`` and whose per-module peft scale carries the block
multipliers (:func:`lora_oracle.scheduled_reference_pipeline`); final latents, fp32, atol 1e-4.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from lora_oracle import reference_latents, reference_pipeline, scheduled_reference_pipeline

from vllm_omni.errors import InvalidAdapterError, InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest

TOL = 1e-4
STEPS = 3
KW = dict(seed=5, guidance=3.0, height=32, width=32)
PROMPTS = ["a red cat on a mat", "a blue house", "two birds"]
PER_STEP = [1.5, 0.5, -0.5]
RANGES = [{"start": 0.0, "end": 0.5, "scale": 2.0}, {"start": 0.5, "end": 1.0, "scale": 0.0}]
RANGES_PER_STEP = [2.0, 2.0, 0.0]  # step fractions 0, 1/3, 2/3
BLOCKS = {"steps": 0.8, "blocks": {"layers.1": 0.0, "noise_refiner": 2.0}}


def _ff_multiplier(name: str) -> float:
    return 0.0 if name.startswith("layers.1.") else 2.0 if name.startswith("noise_refiner.") else 1.0


def _one(name: str) -> float:
    return 1.0


def params(**overrides) -> OmniDiffusionSamplingParams:
    base = dict(
        height=32, width=32, num_inference_steps=STEPS, guidance_scale=3.0, seed=5, output_type="latent"
    )
    base.update(overrides)
    return OmniDiffusionSamplingParams(**base)


@pytest.fixture(scope="module")
def reqs(tiny_z_image_loras):
    return {
        name: LoRARequest(name, i + 1, str(tiny_z_image_loras[name])) for i, name in enumerate(("attn", "ff"))
    }


@pytest.fixture(scope="module")
def cases(reqs):
    """Per case: (requests, public scales, oracle adapters ``(path, step_scales, multiplier)``)."""
    a, f = reqs["attn"], reqs["ff"]
    return {
        "per-step": ([a], [PER_STEP], [(a.lora_path, PER_STEP, _one)]),
        "ranges+blocks": (
            [a, f],
            [RANGES, BLOCKS],
            [(a.lora_path, RANGES_PER_STEP, _one), (f.lora_path, [0.8] * STEPS, _ff_multiplier)],
        ),
        "none": ([], [], []),
    }


@pytest.fixture(scope="module")
def oracle(tiny_z_image_dir):
    cache: dict = {}

    @torch.no_grad()
    def run(adapters, prompt):
        key = (tuple((p, tuple(s), m.__name__) for p, s, m in adapters), prompt)
        if key not in cache:
            if adapters:
                pipe, callback = scheduled_reference_pipeline(tiny_z_image_dir, adapters, STEPS)
            else:
                pipe, callback = reference_pipeline(tiny_z_image_dir), None
            cache[key] = pipe(
                prompt,
                num_inference_steps=STEPS,
                guidance_scale=KW["guidance"],
                generator=torch.Generator().manual_seed(KW["seed"]),
                output_type="latent",
                height=KW["height"],
                width=KW["width"],
                callback_on_step_end=callback,
            ).images
        return cache[key]

    return run


def _err(a, b) -> float:
    return (a - b).abs().max().item()


def test_omni_schedules_match_diffusers_callback_and_mix_in_one_batch(tiny_z_image_dir, reqs, cases, oracle):
    from vllm_omni import Omni

    omni = Omni(model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False, max_loras=2)
    try:
        names = list(cases)
        stage = omni._orchestrator.runtimes[0]
        before = len(stage.batch_sizes)
        outs = omni.generate(
            PROMPTS,
            params(),
            lora_requests=[cases[n][0] for n in names],
            lora_scales=[cases[n][1] for n in names],
        )
        assert stage.batch_sizes[before:] == [3], "the three requests must share one denoiser batch"
        constant = omni.generate(PROMPTS[0], params(), lora_requests=[reqs["attn"]], lora_scales=[1.5])[0]
        for prompt, name, out in zip(PROMPTS, names, outs, strict=True):
            reqs_, scales, adapters = cases[name]
            solo = omni.generate(prompt, params(lora_requests=reqs_, lora_scales=scales))[0]
            assert _err(out.latents, solo.latents) <= 1e-5, name
            err = _err(out.latents, oracle(adapters, prompt))
            print(f"schedule {name}: max abs err vs diffusers+peft callback {err:.2e}")
            assert err <= TOL, name
        # the schedule really differs from its first step's constant scale
        assert _err(outs[0].latents, constant.latents) > 50 * TOL
        with pytest.raises(
            InvalidRequestError, match=r"has 2 per-step values but num_inference_steps is 3.*'attn'"
        ):
            omni.generate(PROMPTS[0], params(), lora_requests=[reqs["attn"]], lora_scales=[[1.0, 0.5]])
        cached = omni.list_loras()
        with pytest.raises(
            InvalidAdapterError, match="blocks pattern 'single_blocks.\\*' matches no LoRA layer"
        ):
            omni.generate(
                PROMPTS[0],
                params(),
                lora_requests=[reqs["attn"]],
                lora_scales=[{"blocks": {"single_blocks.*": 0}}],
            )
        assert omni.list_loras() == cached
    finally:
        omni.shutdown()


def test_async_omni_runs_a_schedule(tiny_z_image_dir, cases, oracle):
    from vllm_omni import AsyncOmni

    reqs_, scales, adapters = cases["ranges+blocks"]

    async def main(omni):
        return [
            out async for out in omni.generate(PROMPTS[1], params(), lora_requests=reqs_, lora_scales=scales)
        ]

    omni = AsyncOmni(model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False, max_loras=2)
    try:
        out = asyncio.run(main(omni))[-1]
    finally:
        omni.shutdown()
    assert _err(out.latents, oracle(adapters, PROMPTS[1])) <= TOL


def test_reference_without_schedule_equals_the_plain_oracle(tiny_z_image_dir, reqs, oracle):
    """The callback oracle with a constant schedule is the plain ``set_adapters`` oracle (sanity)."""
    a = reqs["attn"]
    plain = reference_latents(
        reference_pipeline(tiny_z_image_dir, [(a.lora_path, 0.7)]), PROMPTS[0], steps=STEPS, **KW
    )
    assert _err(plain, oracle([(a.lora_path, [0.7] * STEPS, _one)], PROMPTS[0])) <= 1e-6
