"""The stage-worker message protocol, the LoRA journal and the ``worker_backend`` option (no engine)."""

from __future__ import annotations

import sys

import pytest
import torch

from vllm_omni.config.omni_config import WORKER_BACKENDS
from vllm_omni.engine.workers import protocol as P
from vllm_omni.engine.workers.client import describe_exit
from vllm_omni.engine.workers.lora_journal import LoRAJournal
from vllm_omni.errors import (
    ConfigError,
    InvalidAdapterError,
    InvalidRequestError,
    LoRAFormatError,
    LoRANotEnabledError,
    StageDeadError,
    StageEngineError,
)
from vllm_omni.lora.request import LoRARequest


@pytest.mark.parametrize(
    "msg",
    [
        P.Submit(3, b"x", stream=True),
        P.Abort(3),
        P.Call(7, "add_lora", b"\x00"),
        P.Hold(),
        P.Release(),
        P.Shutdown(2.5),
        P.Shutdown(),
    ],
)
def test_messages_to_the_worker_round_trip(msg):
    assert P.decode_to_worker(P.encode(msg)) == msg


@pytest.mark.parametrize(
    "msg",
    [
        P.Ready(12),
        P.Accepted(1),
        P.Output(1, b"o"),
        P.Partial(1, b"p"),
        P.Failed(-1, b"e"),
        P.CallResult(2, False, b""),
    ],
)
def test_messages_from_the_worker_round_trip(msg):
    assert P.decode_from_worker(P.encode(msg)) == msg


def test_a_reply_is_not_a_request():
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        P.decode_to_worker(P.encode(P.Ready(1)))


@pytest.mark.parametrize(
    "exc",
    [
        InvalidAdapterError("adapter 'x' (id 3): rank 64 > max_lora_rank 16"),
        LoRAFormatError("adapter 'x': not a directory"),
        LoRANotEnabledError("stage 0 (llm_ar) does not have LoRA enabled"),
        InvalidRequestError("bad seed"),
        ConfigError("bad option", options=("max_loras",)),
        StageDeadError("stage 1: gone"),
        ValueError("plain"),
    ],
)
def test_errors_cross_with_their_class_and_message(exc):
    back = P.load_error(P.dump_error(exc))
    assert type(back) is type(exc) and str(back) == str(exc)


def test_an_error_that_cannot_cross_becomes_a_stage_engine_error():
    class Local(Exception):  # not importable in the other process: pickling fails
        pass

    back = P.load_error(P.dump_error(Local("boom")))
    assert type(back) is StageEngineError and "Local: boom" in str(back)


def test_payloads_carry_tensors_and_python_objects():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    obj = {"latents": t, "request": LoRARequest("a", 1, "/tmp/a"), "text": "hi"}
    back = P.load(P.dump(obj))
    assert torch.equal(back["latents"], t) and back["request"] == obj["request"] and back["text"] == "hi"


def test_exit_descriptions():
    assert describe_exit(-9) == "killed by signal SIGKILL"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(None) == "exit status unknown"


def test_journal_replays_the_net_effect_in_order():
    a, b, c = (LoRARequest(n, i, f"/tmp/{n}") for i, n in enumerate("abc", start=1))
    journal = LoRAJournal()
    for method, args in [
        ("add_lora", (a,)),
        ("add_lora", (b,)),
        ("pin_lora", (1,)),
        ("pin_lora", (2,)),
        ("list_loras", ()),
        ("remove_lora", (2,)),
        ("add_lora", (c,)),
        ("add_lora", (a,)),  # a repeat keeps the first position
    ]:
        journal.record(method, args)
    calls = []
    journal.replay(lambda method, *args: calls.append((method, args)))
    assert calls == [("add_lora", (a,)), ("add_lora", (c,)), ("pin_lora", (1,))]


# ---------------------------------------------------------------- the worker_backend option
def _config(tiny_llm_assets, **kwargs):
    from vllm_omni.entrypoints.omni_base import build_omni_config

    return build_omni_config(str(tiny_llm_assets.model_dir), **kwargs)


def test_worker_backend_defaults_and_sources(tiny_llm_assets, tmp_path):
    assert _config(tiny_llm_assets).worker_backend == "inline"
    for backend in WORKER_BACKENDS:
        assert _config(tiny_llm_assets, worker_backend=backend).worker_backend == backend
    deploy = tmp_path / "d.yaml"
    deploy.write_text("worker_backend: mp\nstages: []\n")
    assert _config(tiny_llm_assets, deploy_config=str(deploy)).worker_backend == "mp"
    # an explicit value wins over the deploy YAML
    assert (
        _config(tiny_llm_assets, deploy_config=str(deploy), worker_backend="inline").worker_backend
        == "inline"
    )
    # the option is pipeline-wide: it reaches no stage's options
    assert all(
        "worker_backend" not in s.options for s in _config(tiny_llm_assets, worker_backend="mp").stages
    )


def test_bad_worker_backend_is_a_config_error(tiny_llm_assets, tmp_path):
    with pytest.raises(
        ConfigError, match=r"keyword argument 'worker_backend': unknown worker backend 'threads'"
    ):
        _config(tiny_llm_assets, worker_backend="threads")
    deploy = tmp_path / "d.yaml"
    deploy.write_text("worker_backend: procs\nstages: []\n")
    with pytest.raises(ConfigError, match=r"d.yaml', worker_backend: unknown worker backend 'procs'.*'mp'"):
        _config(tiny_llm_assets, deploy_config=str(deploy))


def test_serve_defaults_to_mp_and_takes_the_flag(tiny_llm_assets, tmp_path):
    from vllm_omni.entrypoints.cli.serve import parse_serve_argv

    model = str(tiny_llm_assets.model_dir)
    launch, _ = parse_serve_argv([model])
    assert launch.options == {} and launch.build_config().worker_backend == "mp"
    launch, _ = parse_serve_argv([model, "--worker-backend", "inline"])
    assert launch.build_config().worker_backend == "inline"
    deploy = tmp_path / "d.yaml"
    deploy.write_text("worker_backend: inline\nstages: []\n")
    launch, _ = parse_serve_argv([model, "--deploy-config", str(deploy)])
    assert launch.build_config().worker_backend == "inline"  # the YAML over serve's default
    with pytest.raises(SystemExit):
        parse_serve_argv([model, "--worker-backend", "threads"])


def test_ray_backend_without_ray_names_the_extra(tiny_llm_assets, monkeypatch):
    from vllm_omni.engine.stage_factory import make_stage_runtime

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    stage = _config(tiny_llm_assets).stages[0]
    with pytest.raises(ConfigError, match=r"pip install 'vllm-omni\[ray\]'"):
        make_stage_runtime(stage, "ray")
    with pytest.raises(ConfigError, match="unknown worker backend"):
        make_stage_runtime(stage, "nope")
