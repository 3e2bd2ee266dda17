"""Tensor-parallel (TP=2, gloo, two spawned worker processes) equals TP=1."""

from __future__ import annotations

import pytest

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2_engine(tiny_z_image_dir):
    engine = DiffusionEngine(
        OmniDiffusionConfig(
            model=str(tiny_z_image_dir), tensor_parallel_size=2, device="cpu", enable_progress_bar=False
        )
    )
    yield engine
    engine.shutdown()


def _shard_rows(worker):
    """Runs in each worker: per-rank sizes of the first packed qkv weight."""
    qkv = worker.pipeline.transformer.layers[0].attention.to_qkv
    return tuple(qkv.weight.shape)


def test_tp2_equals_tp1(tp2_engine, z_image_engine):
    prompts = ["a red cat", "a lighthouse on a cliff at night"]
    sp = OmniDiffusionSamplingParams(
        height=32, width=48, num_inference_steps=3, guidance_scale=3.0, negative_prompt="blurry", seed=2
    )
    tp1 = z_image_engine.generate(prompts, sp)
    tp2 = tp2_engine.generate(prompts, sp)
    for a, b in zip(tp1, tp2, strict=True):
        assert b.prompt == a.prompt
        assert (a.latents - b.latents).abs().max().item() <= 1e-4
        assert b.images[0].size == (48, 32)


def test_tp2_collective_rpc_reaches_every_rank(tp2_engine):
    infos = tp2_engine.collective_rpc("describe")
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2}
    assert tp2_engine.collective_rpc(getattr, "rank") == [0, 1]
    # Heads are sharded: each rank holds half of the 3 * 64 packed q/k/v rows.
    assert tp2_engine.collective_rpc(_shard_rows) == [(96, 64), (96, 64)]
    with pytest.raises(RuntimeError, match="tensor_parallel_size=1"):
        _ = tp2_engine.pipeline


def test_tp2_worker_errors_propagate(tp2_engine):
    with pytest.raises(ValueError, match="height must be a multiple of 16"):
        tp2_engine.generate(["x"], OmniDiffusionSamplingParams(height=40, width=32, num_inference_steps=1))
    with pytest.raises(AttributeError, match="no_such_method"):
        tp2_engine.collective_rpc("no_such_method")
    # The engine is still usable afterwards.
    assert tp2_engine.collective_rpc(getattr, "world_size") == [2, 2]
