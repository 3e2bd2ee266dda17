"""Tensor-parallel (TP=2, gloo, two rank processes) equals TP=1; the ranks fork from the
preloaded worker fork server (``vllm_omni/worker_start.py``) or, when they must, spawn."""

from __future__ import annotations

import logging
import multiprocessing
import os

import pytest

from tests.fork_server import match_the_fork_server
from vllm_omni import worker_start as start
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine, _guarded_worker_main, rank_process
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2_engine(tiny_z_image_dir):
    with pytest.MonkeyPatch.context() as monkeypatch:
        match_the_fork_server(monkeypatch)  # not what earlier tests of this pytest worker left set
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


def _how_started(worker):
    """Runs in each rank: its parent process and whether vLLM was imported before its entry point ran."""
    return os.getppid(), start.preloaded_at_entry


def test_tp2_ranks_fork_from_the_preloaded_server(tp2_engine):
    assert tp2_engine.start_methods == ["forkserver", "forkserver"]
    server = start._server_pid
    assert server is not None and server != os.getpid()
    # children of the fork server, which had imported vLLM (and the rank's modules) before either began
    assert tp2_engine.collective_rpc(_how_started) == [(server, True), (server, True)]


def _rank(od_config):
    """The unstarted process of rank 1 and how it would start (its pipe closed: it never starts)."""
    ours, theirs = multiprocessing.Pipe()
    try:
        return rank_process(od_config, 1, 2, "file:///never-used", theirs)
    finally:
        ours.close()
        theirs.close()


def test_a_rank_spawns_when_its_environment_cannot_fork_or_when_asked(tp2_engine, monkeypatch, caplog):
    match_the_fork_server(monkeypatch)
    proc, how = _rank(tp2_engine.od_config)
    assert (how, proc._start_method, proc.daemon) == ("forkserver", "forkserver", True)
    assert proc._target is start.preloaded_main and proc._args[0] is _guarded_worker_main
    # a variable an import may have read differs from the fork server's: this rank is spawned, and says why
    with monkeypatch.context() as m, caplog.at_level(logging.DEBUG, logger=start.__name__):
        m.setenv("HF_HUB_OFFLINE", "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1")
        proc, how = _rank(tp2_engine.od_config)
    assert (how, proc._start_method, proc.daemon) == ("spawn", "spawn", True)
    assert proc._target is _guarded_worker_main
    assert "diffusion rank 1: worker spawned as a fresh interpreter: HF_HUB_OFFLINE differ(s)" in caplog.text
    # the opt-out
    monkeypatch.setenv(start.START_ENV, "spawn")
    proc, how = _rank(tp2_engine.od_config)
    assert (how, proc._start_method, proc._target) == ("spawn", "spawn", _guarded_worker_main)
