"""No diffusion request fails for another's sake (issue 13, item 6), on the shipped demo model.

The demo model's positional tables reach 512 pixels a side and 224 caption tokens. A size it cannot
make is refused when it is submitted (before it can join a batch); an over-long prompt is truncated
with a warning; and when a batch call fails anyway, every member is run alone, so the good requests
get the images they get alone.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.inputs.stage_request import StageRequest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo_model"
GOOD = [
    "a red circle",
    "a blue square",
    "a green triangle",
    "a yellow circle",
    "a red square",
    "a blue circle",
]
LONG = " ".join(["a red circle beside a blue square under a green triangle"] * 10)  # 100 words
pytestmark = pytest.mark.engine


def params(**kw) -> OmniDiffusionSamplingParams:
    base = dict(num_inference_steps=3, guidance_scale=3.0, seed=7, height=64, width=64)
    base.update(kw)
    return OmniDiffusionSamplingParams(**base)


@pytest.fixture(scope="module")
def omni():
    from vllm_omni import Omni

    engine = Omni(model=str(DEMO), dtype="float32", enable_progress_bar=False, max_batch_size=16)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def stage(omni):
    return omni._orchestrator.runtimes[0]


@pytest.fixture(scope="module")
def alone(omni):
    return {p: _pixels(omni.generate(p, params())[0]) for p in GOOD}


def _pixels(out) -> np.ndarray:
    return np.asarray(out.images[0], dtype=np.int16)


def _same_image(batched: np.ndarray, alone: np.ndarray) -> None:
    """A batched image equals the one made alone up to float rounding (1 level of 255)."""
    assert np.abs(batched - alone).max() <= 1


def _submit_together(omni, stage, items):
    """Submit ``(prompt, params)`` pairs while the driver is held, so they form one batch."""
    futures, errors = [], []
    with omni._orchestrator.batching():
        for prompt, sp in items:
            try:
                futures.append(stage.submit(StageRequest(prompt, sp)))
            except InvalidRequestError as exc:
                futures.append(None)
                errors.append(exc)
    return futures, errors


def test_limits_come_from_the_model(stage):
    assert stage.max_size == (512, 512)  # axes_lens 32 x patch 2 x VAE factor 8
    pipeline = stage._engine.pipeline
    assert pipeline.max_prompt_tokens == 224  # (256 - 2) rounded down to the 32-token caption padding
    assert pipeline.default_size == (64, 64)  # the VAE's sample_size


def test_missing_size_is_the_model_default(omni):
    out = omni.generate("a red circle", params(height=None, width=None))[0]
    assert out.images[0].size == (64, 64)


def test_too_large_size_is_refused_before_batching(omni, stage, alone):
    bad = params(height=1024, width=1024)
    with pytest.raises(InvalidRequestError, match="exceeds this model's maximum of 512"):
        stage.validate_request(StageRequest("a red circle", bad))
    before = len(stage.batch_sizes)
    items = [(p, params()) for p in GOOD[:3]] + [("a red circle", bad)] + [(p, params()) for p in GOOD[3:]]
    futures, errors = _submit_together(omni, stage, items)
    assert len(errors) == 1 and "512" in str(errors[0])
    outputs = [f.result(timeout=300) for f in futures if f is not None]
    assert stage.batch_sizes[before:] == [6]
    for prompt, out in zip(GOOD, outputs, strict=True):
        _same_image(_pixels(out), alone[prompt])


def test_long_prompt_is_truncated_with_a_warning(omni, stage, alone, caplog):
    items = [(p, params()) for p in GOOD] + [(LONG, params())]
    with caplog.at_level(logging.WARNING, logger="vllm_omni.diffusion.models.z_image.pipeline"):
        futures, errors = _submit_together(omni, stage, items)
        outputs = [f.result(timeout=300) for f in futures]
    assert not errors
    assert any("truncated" in r.getMessage() for r in caplog.records)
    for prompt, out in zip(GOOD, outputs[:-1], strict=True):
        _same_image(_pixels(out), alone[prompt])
    assert outputs[-1].images[0].size == (64, 64)


def test_a_failing_batch_is_rerun_member_by_member(omni, stage, alone, monkeypatch):
    """Whatever still breaks a batch call (here: injected for one prompt) fails only that request."""
    pipeline = stage._engine.pipeline
    real = pipeline.generate

    def generate(prompts, sp, **kw):
        if "poison" in prompts:
            raise RuntimeError("injected failure")
        return real(prompts, sp, **kw)

    monkeypatch.setattr(pipeline, "generate", generate)
    items = [(p, params()) for p in GOOD[:3]] + [("poison", params())] + [(p, params()) for p in GOOD[3:]]
    futures, _ = _submit_together(omni, stage, items)
    with pytest.raises(RuntimeError, match="injected"):
        futures[3].result(timeout=300)
    good = [f.result(timeout=300) for i, f in enumerate(futures) if i != 3]
    for prompt, out in zip(GOOD, good, strict=True):  # each was rerun alone: the very same image
        np.testing.assert_array_equal(_pixels(out), alone[prompt])
