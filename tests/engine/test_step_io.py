"""The per-request step table (``vllm_omni.engine.step_io``) without an engine: how captured hidden
states are assembled, and which stages may run the stepping worker (the engines' use of it is
tested on Qwen2.5-Omni against transformers: ``tests/omni/test_qwen2_5_omni_audio.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_omni.engine import step_io
from vllm_omni.errors import ConfigError, StageEngineError


@dataclasses.dataclass
class _Stage:
    options: dict
    label: str = "Stage 0 (llm_ar)"


def test_pieces_assemble_by_position_and_a_recomputation_overwrites():
    entry = step_io.StepIOEntry(capture=True)
    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    entry.captured += [(0, rows[:3]), (3, rows[3:4] + 100), (4, rows[4:6]), (3, rows[3:4])]  # 3 recomputed
    assert torch.equal(step_io.hidden_states(entry, 6, "Stage 0"), rows)
    assert torch.equal(step_io.hidden_states(entry, 5, "Stage 0"), rows[:5])  # the last fed position


def test_a_position_never_computed_is_an_error_naming_the_stage_and_position():
    entry = step_io.StepIOEntry(capture=True, captured=[(0, torch.zeros(2, 4)), (3, torch.zeros(1, 4))])
    with pytest.raises(StageEngineError, match=r"Stage 0 \(llm_ar\): no hidden state .* position 2 of 4"):
        step_io.hidden_states(entry, 4, "Stage 0 (llm_ar)")
    with pytest.raises(StageEngineError, match="computed no position"):
        step_io.hidden_states(step_io.StepIOEntry(capture=True), 1, "Stage 0 (llm_ar)")


def test_entries_are_found_by_the_key_in_extra_args_and_closed_once():
    from vllm import SamplingParams

    entry = step_io.StepIOEntry(stream=torch.zeros(1, 2), stream_start=3)
    key = step_io.open_entry(entry)
    params = SamplingParams(max_tokens=4, extra_args={"mine": 1})
    keyed = step_io.with_entry(params, key, skip_prefix_cache=True)
    assert params.extra_args == {"mine": 1} and not params.skip_reading_prefix_cache  # a clone
    assert keyed.extra_args["mine"] == 1 and keyed.skip_reading_prefix_cache
    assert step_io.lookup(keyed.extra_args) is entry and step_io.lookup(params.extra_args) is None
    assert step_io.close_entry(key) is entry and step_io.close_entry(key) is None
    assert step_io.lookup(keyed.extra_args) is None
    # the runner looks up every request of a step: a value it cannot key on is "not ours", never an error
    for extra in ({step_io.EXTRA_ARGS_KEY: ["x"]}, {step_io.EXTRA_ARGS_KEY: {"k": 1}}, ["x"], "x", None):
        assert step_io.lookup(extra) is None


@pytest.mark.parametrize(
    ("options", "env", "culprit"),
    [
        ({"worker_cls": "my.Worker"}, None, "worker_cls 'my.Worker' cannot be combined"),
        ({"tensor_parallel_size": 2}, None, "tensor_parallel_size must be 1"),
        ({"pipeline_parallel_size": 2}, None, "pipeline_parallel_size must be 1"),
        ({"data_parallel_size": 2}, None, "data_parallel_size must be 1"),
        ({"speculative_config": {"method": "ngram"}}, None, "remove speculative_config"),
        ({}, "1", "unset VLLM_ENABLE_V1_MULTIPROCESSING"),
    ],
)
def test_stages_that_cannot_host_the_table_are_refused_naming_stage_and_option(
    monkeypatch, options, env, culprit
):
    if env is not None:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", env)
    with pytest.raises(ConfigError, match=rf"Stage 0 \(llm_ar\): the talker's reply stream .*{culprit}"):
        step_io.check_in_process(_Stage(options), "the talker's reply stream")


def test_a_stage_that_can_gets_the_platform_worker(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    opts = step_io.check_in_process(_Stage({"dtype": "float32", "worker_cls": "auto"}), "x")
    assert opts == {"dtype": "float32", "worker_cls": step_io.CPU_WORKER}
    from vllm_omni.engine.step_io_worker import StepIOCPUWorker

    assert f"{StepIOCPUWorker.__module__}.{StepIOCPUWorker.__qualname__}" == step_io.CPU_WORKER
