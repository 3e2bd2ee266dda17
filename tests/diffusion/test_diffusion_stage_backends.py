"""Diffusion LoRA on the diffusers fallback, the distill backend, AsyncOmni and TP=2, against diffusers+peft."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch
from lora_oracle import (
    fused_reference_pipeline,
    reference_latents,
    reference_pipeline,
    scheduled_reference_pipeline,
)

from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest

TOL = 1e-4
KW = dict(seed=9, steps=2, guidance=2.0, height=32, width=32)
PROMPT = "a lighthouse at dusk"


def params(**overrides) -> OmniDiffusionSamplingParams:
    base = dict(height=32, width=32, num_inference_steps=2, guidance_scale=2.0, seed=9, output_type="latent")
    base.update(overrides)
    return OmniDiffusionSamplingParams(**base)


@pytest.fixture(scope="module")
def reqs(tiny_z_image_loras):
    return {n: LoRARequest(n, i + 1, str(tiny_z_image_loras[n])) for i, n in enumerate(("attn", "qv", "ff"))}


def _ref(z_dir, adapters=(), prompt=PROMPT):
    return reference_latents(reference_pipeline(z_dir, list(adapters)), prompt, **KW)


def _err(a, b) -> float:
    return (a - b).abs().max().item()


def _omni(z_dir, **kw):
    from vllm_omni import Omni

    return Omni(model=str(z_dir), dtype="float32", enable_progress_bar=False, **kw)


def test_diffusers_fallback_wraps_linear_and_matches_peft(tiny_z_image_dir, reqs):
    a, q = reqs["attn"], reqs["qv"]
    with _omni(tiny_z_image_dir, pipeline_backend="diffusers", max_loras=2) as omni:
        stage = omni._orchestrator.runtimes[0]
        info = stage.collective_rpc("describe")[0]
        assert info["pipeline"] == "DiffusersFallbackPipeline" and info["lora_layers"] > 0
        assert not stage.mixed_lora_batch
        base = omni.generate(PROMPT, params())[0].latents
        for names, scales in (
            (["attn"], [0.5]),
            (["attn"], [2.0]),
            (["qv"], [1.0]),
            (["attn", "qv"], [0.8, 0.6]),
        ):
            got = omni.generate(PROMPT, params(), lora_requests=[reqs[n] for n in names], lora_scales=scales)[
                0
            ].latents
            expected = _ref(tiny_z_image_dir, [(reqs[n].lora_path, s) for n, s in zip(names, scales)])
            err = _err(got, expected)
            print(f"fallback {names} {scales}: max abs err {err:.2e}", file=sys.stderr)
            assert err <= TOL and _err(got, base) > 50 * TOL
        assert torch.equal(omni.generate(PROMPT, params())[0].latents, base)
        # different adapter sets are not mixed in one diffusers call, but each is still right
        before = len(stage.batch_sizes)
        outs = omni.generate([PROMPT, PROMPT, PROMPT], params(), lora_request=[a, None, a])
        assert sorted(stage.batch_sizes[before:]) == [1, 2]
        assert _err(outs[0].latents, _ref(tiny_z_image_dir, [(a.lora_path, 1.0)])) <= TOL
        assert torch.equal(outs[1].latents, base)
        assert q.lora_int_id in omni.list_loras()
        # scale schedules: block multipliers apply (diffusers' own layer names); per-step scales need
        # a loop that reports its steps, which diffusers' pipeline does not: refused, not ignored
        blocks = {"steps": 0.8, "blocks": {"layers.1": 0.0, "noise_refiner": 2.0}}
        got = omni.generate(PROMPT, params(), lora_requests=[a], lora_scales=[blocks])[0].latents
        pipe, _ = scheduled_reference_pipeline(
            tiny_z_image_dir,
            [
                (
                    a.lora_path,
                    [0.8, 0.8],
                    lambda n: (
                        0.0 if n.startswith("layers.1.") else 2.0 if n.startswith("noise_refiner.") else 1.0
                    ),
                )
            ],
            2,
        )
        assert _err(got, reference_latents(pipe, PROMPT, **KW)) <= TOL
        assert _err(got, _ref(tiny_z_image_dir, [(a.lora_path, 0.8)])) > 50 * TOL
        with pytest.raises(InvalidRequestError, match="per-step scales need a pipeline that reports"):
            omni.generate(PROMPT, params(), lora_requests=[a], lora_scales=[[1.0, 0.5]])


def test_distill_backend_fuses_once_and_request_adapters_add_on_top(
    tiny_z_image_dir, tiny_z_image_loras, reqs
):
    lora_file = str(tiny_z_image_loras["attn_file"])
    fused_ref = reference_latents(fused_reference_pipeline(tiny_z_image_dir, lora_file, 0.7), PROMPT, **KW)
    with _omni(tiny_z_image_dir, lora_backend="distill", lora_path=lora_file, lora_scale=0.7) as omni:
        assert omni.list_loras() == set()  # fused, not cached
        got = omni.generate(PROMPT, params())[0].latents
        err = _err(got, fused_ref)
        print(f"distill fuse vs diffusers fuse_lora: max abs err {err:.2e}", file=sys.stderr)
        assert err <= TOL and _err(got, _ref(tiny_z_image_dir)) > 50 * TOL
        on_top = omni.generate(PROMPT, params(), lora_request=reqs["qv"])[0].latents
        expected = _ref(tiny_z_image_dir, [(tiny_z_image_loras["attn"], 0.7), (reqs["qv"].lora_path, 1.0)])
        assert _err(on_top, expected) <= TOL


def test_async_omni_generates_images_and_manages_loras(tiny_z_image_dir, reqs):
    from vllm_omni import AsyncOmni

    a = reqs["attn"]

    async def main(omni):
        async def one(prompt, **kw):
            return [out async for out in omni.generate(prompt, params(output_type="pil"), **kw)]

        assert await omni.add_lora(a)
        assert await omni.list_loras() == {a.lora_int_id}
        plain, adapted = await asyncio.gather(one(PROMPT), one(PROMPT, lora_request=a, lora_scale=1.0))
        assert await omni.pin_lora(a.lora_int_id)
        composed = await one(PROMPT, lora_requests=[a, reqs["qv"]], lora_scales=[0.8, 0.6])
        assert await omni.remove_lora(a.lora_int_id)
        return plain[0], adapted[0], composed[0]

    omni = AsyncOmni(model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False, max_loras=2)
    try:
        plain, adapted, composed = asyncio.run(main(omni))
    finally:
        omni.shutdown()
    assert plain.images[0].size == (32, 32) and plain.final_output_type == "image"
    assert _err(plain.latents, _ref(tiny_z_image_dir)) <= TOL
    assert _err(adapted.latents, _ref(tiny_z_image_dir, [(a.lora_path, 1.0)])) <= TOL
    assert (
        _err(composed.latents, _ref(tiny_z_image_dir, [(a.lora_path, 0.8), (reqs["qv"].lora_path, 0.6)]))
        <= TOL
    )


@pytest.mark.slow
def test_tp2_two_composed_adapters_equal_tp1(tiny_z_image_dir, reqs):
    a, q, f = reqs["attn"], reqs["qv"], reqs["ff"]
    sets = [([a, q], [0.8, 0.6]), ([f], [-1.0]), ([], [])]
    prompts = [PROMPT, "a small boat", "green hills"]

    def run(tp):
        with _omni(tiny_z_image_dir, tensor_parallel_size=tp, max_loras=3) as omni:
            assert omni.add_lora(a) and omni.pin_lora(a.lora_int_id)
            outs = omni.generate(
                prompts, params(), lora_requests=[s for s, _ in sets], lora_scales=[sc for _, sc in sets]
            )
            stage = omni._orchestrator.runtimes[0]
            per_rank = stage.collective_rpc("list_loras")
            assert len(per_rank) == tp and all(ids == per_rank[0] for ids in per_rank)
            assert omni.remove_lora(f.lora_int_id)
            assert set(stage.collective_rpc("list_loras")[-1]) == {a.lora_int_id, q.lora_int_id}
            return [o.latents for o in outs]

    tp1, tp2 = run(1), run(2)
    errs = [_err(x, y) for x, y in zip(tp1, tp2)]
    print(f"TP=2 vs TP=1 (composed adapters): max abs errs {errs}", file=sys.stderr)
    assert max(errs) <= TOL
    assert _err(tp2[0], _ref(tiny_z_image_dir, [(a.lora_path, 0.8), (q.lora_path, 0.6)])) <= TOL
