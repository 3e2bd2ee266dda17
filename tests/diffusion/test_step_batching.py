"""Step-level batching (stage option ``batching="step"``, issue 48) on the shipped demo model (a tiny Z-Image).

Reference: the same request run alone by the pipeline's own ``generate`` (whole-request batching,
itself checked against diffusers' ``ZImagePipeline`` + peft in test_z_image_pipeline / test_lora_z_image).
Requests join a running batch mid-flight with different step counts, adapters, per-step and per-block
schedules, guidance (CFG on and off), images per prompt, negative prompts, seeds and sizes.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_omni.diffusion.step_batching import StepBatcher, step_unit_for
from vllm_omni.errors import InvalidRequestError, LoRAFormatError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import NO_ADAPTERS, LoRARequest, RequestAdapter, RequestAdapters
from vllm_omni.lora.schedule import LoRAScaleSchedule

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo_model"
WARM = LoRARequest("warm", 1, str(DEMO / "adapters" / "warm"))
STRIPES = LoRARequest("stripes", 2, str(DEMO / "adapters" / "stripes"))
pytestmark = pytest.mark.engine


def sp(steps: int, guidance: float, **kw) -> OmniDiffusionSamplingParams:
    base = dict(num_inference_steps=steps, guidance_scale=guidance, height=64, width=64, output_type="latent")
    return OmniDiffusionSamplingParams(**{**base, **kw})


def adapters(*pairs) -> RequestAdapters:
    return RequestAdapters(tuple(RequestAdapter(lora, scale) for lora, scale in pairs))


#: (joins before step tick, prompt, params, adapters, seed): five requests, two latent shapes
SCRIPT = [
    (0, "a red circle", sp(6, 3.0), NO_ADAPTERS, 11),
    (2, "a blue square", sp(3, 0.0), adapters((WARM, 0.8)), 12),
    (
        2,
        "a green triangle",
        sp(4, 4.0, num_images_per_prompt=2),
        adapters((STRIPES, [0.0, 1.0, 0.5, 2.0])),
        13,
    ),
    (
        3,
        "a tall yellow circle",
        sp(3, 2.0, height=96),
        adapters(
            (WARM, 1.0), (STRIPES, LoRAScaleSchedule.parse({"steps": [1.0, -0.5, 0.3], "blocks": {"0": 0.0}}))
        ),
        14,
    ),
    (4, "a red square", sp(4, 3.0, negative_prompt="blurry"), NO_ADAPTERS, 15),
]


def run_script(worker, script) -> tuple[dict[int, torch.Tensor], list[int]]:
    """Run ``script`` on a fresh :class:`StepBatcher` over the stage's worker (on the driver thread):
    request ``i`` joins before tick ``script[i][0]``; returns each request's final latents and the
    denoiser samples of every step."""
    batcher = StepBatcher(worker, step_unit_for(worker.pipeline))
    out, sizes, tick = {}, [], 0
    while len(out) < len(script):
        for rid, (at, prompt, params, ads, seed) in enumerate(script):
            if at == tick:
                batcher.admit(rid, prompt, params, ads, seed)
        finished, samples = batcher.step()
        sizes.append(samples)
        for rid, res in finished:
            assert not isinstance(res, BaseException), res
            out[rid] = res.latents
        tick += 1
    return out, sizes


def _parsed(ads: RequestAdapters) -> RequestAdapters:
    """``ads`` with per-step lists parsed into schedules, as the entry point parses them."""
    return RequestAdapters(
        tuple(
            RequestAdapter(a.lora, LoRAScaleSchedule.parse(a.scale) if isinstance(a.scale, list) else a.scale)
            for a in ads
        )
    )


SCRIPT = [(at, p, params, _parsed(ads), seed) for at, p, params, ads, seed in SCRIPT]


@pytest.fixture(scope="module")
def omni():
    from vllm_omni import Omni

    engine = Omni(
        model=str(DEMO),
        dtype="float32",
        enable_progress_bar=False,
        max_batch_size=8,
        max_loras=2,
        batching="step",
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def stage(omni):
    runtime = omni._orchestrator.runtimes[0]
    assert runtime.batching == "step"
    return runtime


@pytest.fixture(scope="module")
def alone(stage):
    """Each request of :data:`SCRIPT` run alone by the pipeline's ``generate``."""
    out = {}
    for rid, (_, prompt, params, ads, seed) in enumerate(SCRIPT):
        [res] = stage.collective_rpc("generate_batch", [prompt], params, [ads], [seed])[0]
        out[rid] = res.latents
    return out


def test_rows_joining_mid_flight_equal_each_request_alone(stage, alone):
    [(latents, sizes)] = stage.collective_rpc(run_script, SCRIPT)
    assert (
        max(sizes) >= 7
    )  # three requests at different steps, with different adapters and CFG, shared a call
    for rid, ref in alone.items():
        torch.testing.assert_close(
            latents[rid], ref, atol=1e-5, rtol=1e-5, msg=lambda m, r=rid: f"request {r}: {m}"
        )

    # A row without adapters gets exactly what it gets next to neighbours without adapters: the
    # neighbours' adapters add exactly nothing to it.
    bare = [(at, p, params, NO_ADAPTERS, seed) for at, p, params, _, seed in SCRIPT]
    [(base, _)] = stage.collective_rpc(run_script, bare)
    for rid in (0, 4):
        assert torch.equal(latents[rid], base[rid])
    assert not torch.allclose(latents[1], base[1])  # the adapters did act on their own rows


def _nan_adapter(tmp_path: Path) -> LoRARequest:
    dst = tmp_path / "nan_warm"
    shutil.copytree(WARM.lora_path, dst)
    [file] = sorted(dst.glob("*.safetensors"))
    weights = load_file(file)
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()}, file)
    return LoRARequest("nan_warm", 9, str(dst))


def _wait_running(stage, n: int) -> None:
    """Wait (on progress, no fixed timeout) until ``n`` requests run."""
    while stage.stats().running < n:
        time.sleep(0.01)


def test_failing_and_cancelled_requests_leave_the_running_batch_unchanged(stage, alone, tmp_path):
    _, prompt, params, ads, seed = SCRIPT[0]
    long = sp(12, 3.0, seed=seed)
    [ref] = stage.collective_rpc("generate_batch", [prompt], long, [ads], [seed])[0]
    before = stage.stats()
    running = stage.submit(StageRequest(prompt, long))
    _wait_running(stage, 1)
    bad_adapter = stage.submit(StageRequest("x", sp(3, 0.0), RequestAdapters.of(_nan_adapter(tmp_path))))
    bad_args = stage.submit(StageRequest("x", sp(3, 0.0, extra_args={"cfg_normalization": True})))
    cancelled = stage.submit(StageRequest("y", sp(40, 3.0)))
    with pytest.raises(LoRAFormatError, match="nan_warm"):
        bad_adapter.result()
    with pytest.raises(InvalidRequestError, match="extra_args"):
        bad_args.result()
    _wait_running(stage, 2)
    assert cancelled.cancel()
    torch.testing.assert_close(running.result().latents, ref.latents, atol=1e-5, rtol=1e-5)
    after = stage.stats()
    assert after.running == 0
    assert after.failed - before.failed == 2  # the two bad requests; the cancelled one is not counted
    assert after.step_batch.count > before.step_batch.count
    # the stage still serves, and a size the model cannot take is refused before it joins
    with pytest.raises(InvalidRequestError, match="height"):
        stage.submit(StageRequest("z", sp(2, 0.0, height=72)))
    _, prompt, params, ads, seed = SCRIPT[1]
    out = stage.submit(StageRequest(prompt, dataclasses.replace(params, seed=seed), ads))
    torch.testing.assert_close(out.result().latents, alone[1], atol=1e-5, rtol=1e-5)


def test_admission_bounds_the_running_set_and_keeps_order():
    """``max_batch_size`` requests run at once, with at most ``max_loras`` distinct adapters; a request
    that would exceed it waits, later ones that bring new adapters wait behind it, others pass."""
    from collections import deque
    from concurrent.futures import Future
    from types import SimpleNamespace

    from vllm_omni.engine.diffusion_steps import StepScheduling

    def item(*loras):
        return SimpleNamespace(adapters=adapters(*((lora, 1.0) for lora in loras)), future=Future())

    other = LoRARequest("other", 3, WARM.lora_path)
    stage = StepScheduling()
    stage._init_steps()
    stage.max_batch_size, stage.max_loras = 4, 2
    stage._running = {0: (item(WARM), 0.0)}
    blocked, plain, same, behind, gone, late = (
        item(STRIPES, other),
        item(),
        item(WARM),
        item(other),
        item(),
        item(),
    )
    gone.future.cancel()
    stage._queue = deque([blocked, plain, same, behind, gone, late])
    assert stage._take_joining() == [plain, same, late]
    assert list(stage._queue) == [blocked, behind]
    stage._running = {}
    # the first request always joins an empty set (its own adapters are checked when it joins); the
    # next one uses only adapters already joining
    assert stage._take_joining() == [blocked, behind]
    assert not stage._queue
