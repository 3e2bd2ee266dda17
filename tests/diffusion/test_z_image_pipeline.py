"""In-tree Z-Image pipeline (engine, TP=1) against diffusers' ZImagePipeline on the tiny directory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.inputs.data import OmniDiffusionSamplingParams

LATENT_TOL = 1e-4
SIZE = {"height": 32, "width": 48}


def _reference(pipe, prompt, guidance, seed, output_type, negative_prompt=None, n=1, steps=3):
    return pipe(
        prompt,
        num_inference_steps=steps,
        guidance_scale=guidance,
        negative_prompt=negative_prompt,
        num_images_per_prompt=n,
        generator=torch.Generator().manual_seed(seed),
        output_type=output_type,
        **SIZE,
    ).images


@pytest.mark.parametrize(
    ("guidance", "negative"),
    [(0.0, None), (4.0, None), (2.5, "blurry, low quality")],
    ids=["no-cfg", "cfg", "neg"],
)
def test_latents_match_diffusers(z_image_engine, diffusers_z_image, guidance, negative):
    sp = OmniDiffusionSamplingParams(
        num_inference_steps=3,
        guidance_scale=guidance,
        negative_prompt=negative,
        seed=7,
        output_type="latent",
        **SIZE,
    )
    [out] = z_image_engine.generate(["a red cat sitting on a mat"], sp)
    expected = _reference(diffusers_z_image, "a red cat sitting on a mat", guidance, 7, "latent", negative)
    assert out.latents.shape == expected.shape == (1, 16, 4, 6)
    assert out.images == []
    err = (out.latents - expected).abs().max().item()
    assert err <= LATENT_TOL, f"latent max abs err {err}"


def test_decoded_images_match_diffusers(z_image_engine, diffusers_z_image):
    prompt = "an astronaut riding a horse"
    sp = OmniDiffusionSamplingParams(
        num_inference_steps=2, guidance_scale=3.0, seed=3, output_type="np", **SIZE
    )
    [out] = z_image_engine.generate([prompt], sp)
    expected = _reference(diffusers_z_image, prompt, 3.0, 3, "np", steps=2)
    assert out.array.shape == expected.shape == (1, 32, 48, 3)
    assert np.abs(out.array - expected).max() <= 1e-4

    pil = z_image_engine.generate(
        [prompt], OmniDiffusionSamplingParams(num_inference_steps=2, guidance_scale=3.0, seed=3, **SIZE)
    )
    ref_pil = _reference(diffusers_z_image, prompt, 3.0, 3, "pil", steps=2)
    assert pil[0].images[0].size == (48, 32)
    diff = np.abs(np.asarray(pil[0].images[0], dtype=np.int16) - np.asarray(ref_pil[0], dtype=np.int16))
    assert diff.max() <= 1


def test_num_images_per_prompt_matches_diffusers(z_image_engine, diffusers_z_image):
    sp = OmniDiffusionSamplingParams(
        num_inference_steps=2,
        guidance_scale=2.0,
        seed=11,
        num_images_per_prompt=2,
        output_type="latent",
        **SIZE,
    )
    [out] = z_image_engine.generate(["two birds"], sp)
    expected = _reference(diffusers_z_image, "two birds", 2.0, 11, "latent", n=2, steps=2)
    assert out.latents.shape == (2, 16, 4, 6)
    assert (out.latents - expected).abs().max().item() <= LATENT_TOL


def test_batch_of_two_equals_each_alone(z_image_engine):
    prompts = ["a red cat", "a very long prompt about a small boat drifting on a calm lake at dawn"]
    sp = OmniDiffusionSamplingParams(num_inference_steps=3, guidance_scale=3.0, seed=5, **SIZE)
    batched = z_image_engine.generate(prompts, sp)
    assert [o.prompt for o in batched] == prompts
    for prompt, out in zip(prompts, batched, strict=True):
        [alone] = z_image_engine.generate([prompt], sp)
        assert (alone.latents - out.latents).abs().max().item() <= LATENT_TOL
        assert len(out.images) == 1
    assert (batched[0].latents - batched[1].latents).abs().max().item() > 1e-2  # prompts matter


def test_seeded_runs_are_deterministic_and_seed_sensitive(z_image_engine):
    def run(seed):
        sp = OmniDiffusionSamplingParams(
            num_inference_steps=2, guidance_scale=0.0, seed=seed, output_type="latent", **SIZE
        )
        return z_image_engine.generate("a tree", sp)[0].latents

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_explicit_generator_matches_diffusers(z_image_engine, diffusers_z_image):
    sp = OmniDiffusionSamplingParams(
        num_inference_steps=2,
        guidance_scale=0.0,
        generator=torch.Generator().manual_seed(21),
        output_type="latent",
        **SIZE,
    )
    [out] = z_image_engine.generate(["a lamp"], sp)
    expected = _reference(diffusers_z_image, "a lamp", 0.0, 21, "latent", steps=2)
    assert (out.latents - expected).abs().max().item() <= LATENT_TOL


def test_engine_exposes_denoiser_and_rpc(z_image_engine):
    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel

    assert isinstance(z_image_engine.pipeline.transformer, ZImageTransformer2DModel)
    assert z_image_engine.collective_rpc(getattr, "rank") == [0]
    [info] = z_image_engine.collective_rpc("describe")
    assert info["pipeline"] == "ZImagePipeline" and info["world_size"] == 1


class _FakeTTY:
    def __init__(self):
        self.chunks: list[str] = []

    def isatty(self):
        return True

    def write(self, text):
        self.chunks.append(text)

    def flush(self):
        pass


@pytest.mark.parametrize("enabled", [True, False])
def test_progress_bar_only_when_enabled_and_tty(z_image_engine, monkeypatch, enabled):
    import sys

    fake = _FakeTTY()
    monkeypatch.setattr(sys, "stderr", fake)
    monkeypatch.setattr(z_image_engine.pipeline.od_config, "enable_progress_bar", enabled)
    sp = OmniDiffusionSamplingParams(
        num_inference_steps=2, guidance_scale=0.0, seed=0, output_type="latent", **SIZE
    )
    z_image_engine.generate(["a"], sp)
    text = "".join(fake.chunks)
    assert ("2/2" in text) is enabled
