"""Step-level batching on the template families beyond Z-Image: Qwen-Image and Wan with two experts (issue 48).

Reference: each request run alone by the pipeline's own ``generate`` (checked against diffusers + peft in
the family tests and the DiT contract test). Requests join mid-flight with different step counts,
guidance (CFG on and off; on Wan a second expert's scale), negative prompts of different lengths, seeds,
adapters with scales, a per-step schedule and a call-wide LoRA scale; on Wan, rows whose steps need
different experts run as separate denoiser calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_omni.diffusion.step_batching import StepBatcher, step_unit_for
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import NO_ADAPTERS, LoRARequest, RequestAdapter, RequestAdapters
from vllm_omni.lora.schedule import LoRAScaleSchedule

pytestmark = pytest.mark.engine


def _engine(model: Path):
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    return DiffusionEngine(
        OmniDiffusionConfig(
            model=str(model), dtype="float32", device="cpu", enable_progress_bar=False, max_loras=2
        )
    )


def _run(worker, script) -> tuple[dict[int, torch.Tensor], list[int]]:
    """Request ``i`` joins before step tick ``script[i][0]``; each request's final latents and the samples of
    every denoiser call."""
    batcher = StepBatcher(worker, step_unit_for(worker.pipeline))
    out, samples, tick = {}, [], 0
    while len(out) < len(script):
        for rid, (at, prompt, sp, ads, seed) in enumerate(script):
            if at == tick:
                batcher.admit(rid, prompt, sp, ads, seed)
        finished, n = batcher.step()
        samples.append(n)
        for rid, res in finished:
            assert not isinstance(res, BaseException), res
            out[rid] = res.latents
        tick += 1
    return out, samples


def _check(worker, script) -> list[int]:
    latents, samples = _run(worker, script)
    for rid, (_, prompt, sp, ads, seed) in enumerate(script):
        [alone] = worker.generate_batch([prompt], sp, [ads], [seed])
        torch.testing.assert_close(
            latents[rid], alone.latents, atol=1e-5, rtol=1e-5, msg=lambda m, r=rid: f"{r}: {m}"
        )
    return samples


def _ads(*pairs) -> RequestAdapters:
    return RequestAdapters(tuple(RequestAdapter(lora, scale) for lora, scale in pairs))


def test_qwen_image_rows_joining_mid_flight_equal_each_request_alone(
    tiny_qwen_image_dir, tiny_qwen_image_loras
):
    attn = LoRARequest("attn", 1, str(tiny_qwen_image_loras["attn"]))
    mlp = LoRARequest("mlp", 2, str(tiny_qwen_image_loras["mlp"]))

    def sp(steps, guidance, **kw):
        base = dict(
            height=32, width=48, num_inference_steps=steps, guidance_scale=guidance, output_type="latent"
        )
        return OmniDiffusionSamplingParams(**{**base, **kw})

    script = [
        (0, "a red cat", sp(4, 4.0, negative_prompt="blurry"), NO_ADAPTERS, 5),
        (1, "a blue dog", sp(2, 1.0), _ads((attn, 0.7)), 6),
        (
            1,
            "a green bird on a long branch under a bright morning sky",
            sp(3, 3.0, negative_prompt="", extra_args={"attention_kwargs": {"scale": 0.5}}),
            _ads((mlp, LoRAScaleSchedule.parse([1.0, 0.5, -0.3]))),
            7,
        ),
    ]
    engine = _engine(tiny_qwen_image_dir)
    try:
        samples = _check(engine.worker, script)
    finally:
        engine.shutdown()
    assert max(samples) == 2 + 1 + 2  # all three requests shared a call


def test_wan_two_experts_rows_grouped_by_expert_equal_each_request_alone():
    from tests.conftest import test_assets_root
    from tests.diffusion.test_wan_moe_distill import NUM_FRAMES
    from tools.make_tiny_wan import ensure_tiny_wan, ensure_tiny_wan_loras

    model = ensure_tiny_wan(test_assets_root(), moe=True)
    files = ensure_tiny_wan_loras(test_assets_root())
    high, low = (LoRARequest(name, i + 1, str(files[name])) for i, name in enumerate(("high", "low")))

    def sp(steps, guidance, **extra):
        return OmniDiffusionSamplingParams(
            height=32,
            width=48,
            num_inference_steps=steps,
            guidance_scale=guidance,
            output_type="latent",
            extra_args={"num_frames": NUM_FRAMES, **extra},
        )

    # 4 steps: timesteps 1000, 858, 602, 9 with boundary 0.5: steps 0-2 on the high-noise expert
    script = [
        (0, "a red cat running on a mat", sp(4, 3.0), NO_ADAPTERS, 5),
        (1, "a dog", sp(4, 2.0, guidance_scale_2=1.5), _ads((high, 0.8), (low, 0.5)), 6),
        (2, "a bird", sp(2, 0.0), NO_ADAPTERS, 7),
    ]
    engine = _engine(model)
    try:
        samples = _check(engine.worker, script)
    finally:
        engine.shutdown()
    assert 2 + 2 in samples  # two requests at different steps of one expert shared a call
