"""CPU thread planning of ``mp`` workers: the rule (pure) and what a worker's torch actually gets."""

from __future__ import annotations

import logging

import pytest

from vllm_omni.engine.cpu_threads import plan_cpu_threads, plan_pipeline_threads
from vllm_omni.entrypoints.omni_base import build_omni_config

T, B = "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"


def test_cores_are_split_in_contiguous_ranges():
    assert plan_cpu_threads([0, 1], [1, 1], {}) == [{T: "1", B: "0"}, {T: "1", B: "1"}]
    assert plan_cpu_threads(range(8), [1, 1, 1], {}) == [
        {T: "3", B: "0-2"},
        {T: "3", B: "3-5"},
        {T: "2", B: "6-7"},
    ]
    assert plan_cpu_threads([0, 2, 3, 5], [1], {}) == [{T: "4", B: "0,2-3,5"}]


def test_a_worker_with_several_ranks_gets_one_range_per_rank():
    assert plan_cpu_threads(range(8), [2, 1], {}) == [{T: "4", B: "0-1|2-3"}, {T: "4", B: "4-7"}]
    # fewer cores than ranks in its range: vLLM cannot bind one list per rank
    assert plan_cpu_threads(range(3), [2, 1], {}) == [{T: "2", B: "0|1"}, {T: "1", B: "2"}]
    assert plan_cpu_threads(range(2), [2, 1], {}) == [{T: "1", B: "nobind"}, {T: "1", B: "1"}]


def test_fewer_cores_than_workers_gives_one_thread_each_unbound():
    assert plan_cpu_threads([0, 1], [1, 1, 1], {}) == [{T: "1", B: "nobind"}] * 3


def test_the_users_settings_win():
    assert plan_cpu_threads([0, 1], [1, 1], {T: "2"}) == [{}, {}]
    assert plan_cpu_threads([0, 1], [1, 1], {B: "nobind"}) == [{T: "1"}, {T: "1"}]
    assert plan_cpu_threads([], [1], {}) == [{}]


@pytest.fixture(scope="module")
def z_image():
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return str(ensure_tiny_diffusion_assets(test_assets_root())["z_image"])


def test_pipeline_plan_covers_cpu_stages_and_replicas(tiny_llm_assets, caplog):
    llm = str(tiny_llm_assets.model_dir)
    cfg = build_omni_config(llm, pipeline="llm_chain", stage_1_replicas=2)
    with caplog.at_level(logging.INFO, logger="vllm_omni.engine.cpu_threads"):
        plan = plan_pipeline_threads(cfg.stages, "mp", cpu_host=True, cores=range(6), user_env={})
    assert plan == {0: [{T: "2", B: "0-1"}], 1: [{T: "2", B: "2-3"}, {T: "2", B: "4-5"}]}
    assert "6 core(s) for 3 worker(s)" in caplog.text
    assert plan_pipeline_threads(cfg.stages, "inline", cpu_host=True, cores=range(6)) == {}
    assert plan_pipeline_threads(cfg.stages, "ray", cpu_host=True, cores=range(6)) == {}
    # on a CUDA host only the stages placed on "cpu" share the cores; one CPU worker is not planned
    single = build_omni_config(llm, pipeline="llm_chain", stage_0_devices="cuda:0", stage_1_devices="cpu")
    assert plan_pipeline_threads(single.stages, "mp", cpu_host=False, cores=range(6), user_env={}) == {}
    cuda = build_omni_config(llm, pipeline="llm_chain", stage_1_devices="cpu", stage_1_replicas=2)
    assert plan_pipeline_threads(cuda.stages, "mp", cpu_host=False, cores=range(4), user_env={}) == {
        1: [{T: "2", B: "0-1"}, {T: "2", B: "2-3"}]
    }


def test_a_worker_runs_with_its_planned_threads(z_image, monkeypatch):
    """The worker is spawned with the planned variables, so its torch pool has that size."""
    from vllm_omni.engine.stage_factory import make_stage_runtime

    monkeypatch.delenv(T, raising=False)
    monkeypatch.delenv(B, raising=False)
    stage = build_omni_config(z_image, dtype="float32", enable_progress_bar=False).stages[0]
    envs = plan_cpu_threads([0, 1], [1, 1, 1], {})  # 3 workers on 2 cores: 1 thread each
    runtime = make_stage_runtime(stage, "mp", thread_envs=envs)
    try:
        assert runtime.env[T] == "1" and runtime.env[B] == "nobind"
        assert runtime.torch_threads == 1
    finally:
        runtime.shutdown(30)
