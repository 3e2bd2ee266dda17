"""The supervised worker runtime without processes: a fake transport whose workers die on demand.

What is checked here is transport-independent (restart policy, health, replay that restores what
it can, refusal of lost adapters, reaping, the error of an exhausted stage, the stage options and
the one error convention); the ``mp`` and Ray transports run it in
``test_restart_restores.py``, ``test_exhausted_restarts.py``, ``test_mp_llm_chain.py`` and
``tests/omni/test_qwen2_5_omni_workers.py``.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from tests.waiting import wait_until
from vllm_omni import ipc
from vllm_omni.config.supervision import BACKOFF_MAX_S
from vllm_omni.engine.workers.lora_journal import LoRAJournal
from vllm_omni.engine.workers.supervisor import Pending, RestartPolicy, SupervisedStageRuntime
from vllm_omni.errors import (
    AdapterRestoreError,
    ConfigError,
    InvalidAdapterError,
    LoRAFormatError,
    StageDeadError,
    StageEngineError,
)
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.records import StageState
from vllm_omni.lora.request import LoRARequest, RequestAdapter, RequestAdapters


class _FakeWorker:
    def __init__(self, n: int, missing: set[str]):
        self.n, self.missing, self.loras, self.stopped = n, missing, set(), False
        self.pinned_calls: list[int] = []

    def call(self, method: str, *args):
        if method == "add_lora":
            if args[0].lora_path in self.missing:
                raise LoRAFormatError(f"adapter files not found: {args[0].lora_path}")
            self.loras.add(args[0].lora_int_id)
            return True
        if method == "remove_lora":
            self.loras.discard(args[0])
            return True
        if method == "pin_lora":
            self.pinned_calls.append(args[0])
            return True
        return sorted(self.loras)


class _FakeRuntime(SupervisedStageRuntime):
    """Workers are objects; ``fail_starts`` start attempts raise; ``missing`` adapter paths fail to load."""

    def __init__(self, stage, fail_starts: int = 0):
        super().__init__(stage)
        self.fail_starts, self.missing, self.workers = fail_starts, set(), []
        self.started_event = threading.Event()
        self._begin()

    def _start_worker(self):
        if self.workers and self.fail_starts:
            self.fail_starts -= 1
            raise StageEngineError(f"model files of {self.stage.label} are gone")
        worker = _FakeWorker(len(self.workers), self.missing)
        self.workers.append(worker)
        self.started_event.set()
        return worker

    def _stop_worker(self, handle, timeout):
        handle.stopped = True

    def _worker_call(self, handle, method, *args):
        return handle.call(method, *args)

    def _describe(self, handle):
        return f"fake {handle.n}"

    def kill(self):
        self._worker_died(self._handle, "killed by signal SIGKILL")


def _stage(**kw):
    return SimpleNamespace(stage_id=0, label="Stage 0 (diffusion)", **kw)


def _peft_dir(name: str) -> str:
    """A folder with an adapter config and weights bytes (the registry fingerprints the files)."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix=f"lora_{name}_"))
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8}')
    (folder / "adapter_model.safetensors").write_bytes(name.encode() * 8)
    return str(folder)


def _wait(predicate):
    """Wait until ``predicate()`` holds (on progress: the cap only guards against a hang)."""
    wait_until(predicate, "the fake stage's state", cap_s=300, interval_s=0.01)


def test_restart_restores_the_other_adapters_and_refuses_the_lost_one():
    rt = _FakeRuntime(_stage(max_restarts=2, restart_backoff_s=0.0))
    a, b = LoRARequest("a", 1, "/x/a"), LoRARequest("b", 2, "/x/b")
    rt.add_lora(a), rt.add_lora(b), rt.pin_lora(1), rt.pin_lora(2)
    in_flight = Pending(handle=rt._handle)
    rt._track("r1", in_flight)
    rt.missing.add("/x/a")
    rt.kill()
    with pytest.raises(
        StageDeadError, match=r"Stage 0 \(diffusion\): its worker died \(fake 0, killed by signal SIGKILL\)"
    ):
        in_flight.future.result(timeout=300)  # a cap on a hang, not a speed bound
    _wait(lambda: rt.health() == "ready")
    assert rt.restarts == 1 and rt.restart_attempts == 1 and rt.workers[0].stopped
    assert rt.list_loras() == {2}
    failed = rt.failed_loras()
    assert list(failed) == [1] and "adapter 'a' (id 1)" in failed[1] and "/x/a" in failed[1]
    composed = RequestAdapters((RequestAdapter(b), RequestAdapter(a, 0.5)))
    for call in (
        lambda: rt.check_adapters(StageRequest("p", adapters=RequestAdapters.of(a))),
        lambda: rt.check_adapters(StageRequest("p", adapters=composed)),
    ):
        with pytest.raises(AdapterRestoreError, match="/x/a") as err:
            call()
        assert isinstance(err.value, InvalidAdapterError)
    rt.check_adapters(StageRequest("p", adapters=RequestAdapters.of(b)))  # the restored one serves
    # added again once its files are back: no longer failed
    rt.missing.clear()
    rt.add_lora(a)
    assert rt.failed_loras() == {} and rt.list_loras() == {1, 2}
    rt.shutdown()
    assert rt.health() == "dead" and all(w.stopped for w in rt.workers)


def test_exhausted_restarts_say_stage_attempt_and_cause_and_shutdown_reaps_everything():
    rt = _FakeRuntime(_stage(max_restarts=3, restart_backoff_s=0.0), fail_starts=10)
    rt.kill()
    _wait(lambda: rt.health() == "dead")
    assert rt.restart_attempts == 3 and rt.restarts == 0
    with pytest.raises(StageDeadError) as err:
        rt.list_loras()
    message = str(err.value)
    assert message.startswith(
        "Stage 0 (diffusion) is dead: its worker died (fake 0, killed by signal SIGKILL)"
    )
    assert (
        "restart attempt 3 of 3 failed: StageEngineError: model files of Stage 0 (diffusion) are gone"
        in message
    )
    rt.shutdown()
    assert all(w.stopped for w in rt.workers)


def test_max_restarts_counts_attempts_over_the_runtime_life():
    rt = _FakeRuntime(_stage(max_restarts=2, restart_backoff_s=0.0))
    for restarts in (1, 2):
        rt.kill()
        _wait(lambda n=restarts: rt.restarts == n and rt.health() == "ready")
    rt.kill()  # no attempt left
    _wait(lambda: rt.health() == "dead")
    assert "its 2 restart attempt(s) (max_restarts) are used up" in str(rt._dead_error)
    assert rt.restart_attempts == 2
    never = _FakeRuntime(_stage(max_restarts=0, restart_backoff_s=0.0))
    never.kill()
    _wait(lambda: never.health() == "dead")
    assert "max_restarts 0" in str(never._dead_error)


def test_backoff_doubles_per_failed_attempt_and_is_capped():
    policy = RestartPolicy(max_restarts=5, backoff_s=0.5)
    assert [policy.delay(n) for n in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert policy.delay(20) == BACKOFF_MAX_S
    assert RestartPolicy.of(_stage()) == RestartPolicy()  # defaults when the stage sets none


def test_shutdown_while_restarting_stops_the_new_worker():
    rt = _FakeRuntime(_stage(max_restarts=1, restart_backoff_s=0.3))
    rt.kill()
    assert rt.health() == "restarting"
    rt.shutdown()
    for thread in threading.enumerate():  # the restart ends (no fixed sleep): no worker can start after it
        if thread.name == "omni-stage-0-restart":
            thread.join()
    assert rt.health() == "dead" and all(w.stopped for w in rt.workers) and len(rt.workers) == 1


def test_journal_replay_restores_what_it_can():
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    journal = LoRAJournal()
    for method, args in [("add_lora", (a,)), ("add_lora", (b,)), ("pin_lora", (1,)), ("pin_lora", (2,))]:
        journal.record(method, args)
    calls = []

    def call(method, *args):
        calls.append((method, args))
        if method == "add_lora" and args[0] is a:
            raise FileNotFoundError("/a")

    failed = journal.replay(call)
    assert list(failed) == [1] and isinstance(failed[1], FileNotFoundError)
    assert calls == [("add_lora", (a,)), ("add_lora", (b,)), ("pin_lora", (2,))]  # no pin of the lost one

    def dies(method, *args):
        raise StageDeadError("the new worker died")

    with pytest.raises(StageDeadError):  # the restart itself failed, not one adapter
        journal.replay(dies)


def test_errors_cross_with_their_class_and_the_remote_traceback():
    try:
        raise LoRAFormatError("bad file /p/adapter.safetensors")
    except LoRAFormatError as exc:
        back = ipc.load_error(ipc.dump_error(exc, "stage 0 worker"))
    assert type(back) is LoRAFormatError and str(back) == "bad file /p/adapter.safetensors"
    assert any("raised in stage 0 worker" in note for note in back.__notes__)
    with pytest.raises(LoRAFormatError, match="bad file"):
        ipc.unwrap(ipc.RemoteFailure.of(back))
    assert ipc.unwrap(3) == 3

    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}-{b}")

    odd = ipc.load_error(ipc.dump_error(Odd(1, 2)))
    assert type(odd) is StageEngineError and "Odd: 1-2" in str(odd)
    fut: Future = Future()
    Pending(future=fut).fail(StageDeadError("x"))
    assert isinstance(fut.exception(), StageDeadError)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("max_restarts", -1, "max_restarts must be an integer >= 0"),
        ("max_restarts", True, "max_restarts must be an integer >= 0"),
        ("restart_backoff_s", "x", "restart_backoff_s must be a number of seconds >= 0"),
        ("restart_backoff_s", float("inf"), "restart_backoff_s must be a number of seconds >= 0"),
    ],
)
def test_restart_options_are_checked_naming_the_input_and_stage(tiny_llm_assets, key, value, match):
    from vllm_omni.entrypoints.omni_base import build_omni_config

    with pytest.raises(ConfigError, match=rf"stage_0_{key}, stage 0 \(llm_ar\): {match}") as err:
        build_omni_config(str(tiny_llm_assets.model_dir), **{f"stage_0_{key}": value})
    assert err.value.options == (key,)


def test_restart_options_from_kwargs_overrides_and_deploy_yaml(tiny_llm_assets, tmp_path):
    from vllm_omni.entrypoints.omni_base import build_omni_config

    model = str(tiny_llm_assets.model_dir)
    stage = build_omni_config(model).stages[0]
    assert (stage.max_restarts, stage.restart_backoff_s) == (5, 0.5)
    stage = build_omni_config(model, stage_0_max_restarts=2, stage_0_restart_backoff_s=0.25).stages[0]
    assert (stage.max_restarts, stage.restart_backoff_s) == (2, 0.25)
    stage = build_omni_config(model, stage_overrides={"0": {"max_restarts": 0}}).stages[0]
    assert stage.max_restarts == 0
    deploy = tmp_path / "d.yaml"
    deploy.write_text(
        f"model: {model}\nstages:\n  - stage_id: 0\n    max_restarts: 7\n    restart_backoff_s: 2\n"
    )
    stage = build_omni_config(None, deploy_config=str(deploy)).stages[0]
    assert (stage.max_restarts, stage.restart_backoff_s) == (7, 2.0)


def test_a_restart_restores_what_the_registry_holds_and_reports_to_it():
    """Under ``Omni`` the adapter registry, not the runtime's journal, says what a restarted worker
    holds (issue 21: one owner); what a restart could not restore becomes the registry's ``failed``
    state (pin kept), and registering it again makes it ``loaded``/``pinned`` again."""
    from vllm_omni.lora.registry import AdapterRegistry

    rt = _FakeRuntime(_stage(max_restarts=2, restart_backoff_s=0.0))
    reg = AdapterRegistry(
        lambda method, *args, stage_id=None: {0: getattr(rt, method)(*args)}, 0, {0: "Stage 0"}
    )
    rt.attach_adapter_owner(functools.partial(reg.expected_on, 0), functools.partial(reg.note_restart, 0))
    files = {}
    for name in ("a", "b", "c"):
        files[name] = _peft_dir(name)
    a, b, c = (LoRARequest(n, i, files[n]) for i, n in enumerate("abc", start=1))
    assert reg.add(a) and reg.add(b) and reg.add(c) and reg.pin(1) and reg.pin(2)
    assert reg.remove(3)  # removed before the death: not restored
    assert rt.journal.entries() == ([], [])  # the registry is the record, not the journal
    rt.missing.add(files["a"])
    rt.kill()
    _wait(lambda: rt.health() == "ready" and rt.restarts == 1)
    assert rt.list_loras() == {2} and rt.workers[-1].pinned_calls == [2]
    state = reg.get("a").stages[0]
    assert state.state == "failed" and state.pinned and files["a"] in state.error
    assert reg.get("b").stages[0].state == "pinned"
    assert set(reg.failed()) == {0} and list(reg.failed()[0]) == [1]
    rt.missing.clear()
    assert reg.add(a) is False  # same content: loaded again, and pinned as it was
    assert reg.get("a").stages[0].state == "pinned" and reg.failed() == {} and rt.list_loras() == {1, 2}
    rt.shutdown()


def test_a_replica_reports_what_its_restart_lost_with_its_index():
    from vllm_omni.engine.replicas import ReplicatedStageRuntime

    stage = _stage(max_restarts=2, restart_backoff_s=0.0)
    replicas = [_FakeRuntime(stage), _FakeRuntime(stage)]
    runtime = ReplicatedStageRuntime(stage, replicas)
    heard = []
    runtime.attach_adapter_owner(
        lambda: [(LoRARequest("a", 1, "/x/a"), True), (LoRARequest("b", 2, "/x/b"), False)],
        lambda failed, replica: heard.append((replica, failed)),
    )
    replicas[1].missing.add("/x/a")
    replicas[1].kill()
    _wait(lambda: replicas[1].restarts == 1 and replicas[1].health() == "ready")
    [(replica, failed)] = heard
    assert replica == 1 and list(failed) == [1]
    assert failed[1].startswith("replica 1: Stage 0 (diffusion): adapter 'a' (id 1)") and "/x/a" in failed[1]
    assert replicas[1].list_loras() == {2}
    runtime.shutdown()


def test_the_registry_records_which_replica_lost_an_adapter():
    """On a replicated stage the registry's state says which replicas a restart left without the
    adapter (``failed_replicas``, one error line each); re-adding it clears that."""
    from vllm_omni.engine.replicas import ReplicatedStageRuntime
    from vllm_omni.lora.registry import AdapterRegistry

    stage = _stage(max_restarts=2, restart_backoff_s=0.0)
    replicas = [_FakeRuntime(stage), _FakeRuntime(stage)]
    runtime = ReplicatedStageRuntime(stage, replicas)
    reg = AdapterRegistry(
        lambda method, *args, stage_id=None: {0: getattr(runtime, method)(*args)}, 0, {0: "Stage 0"}
    )
    runtime.attach_adapter_owner(
        functools.partial(reg.expected_on, 0), functools.partial(reg.note_restart, 0)
    )
    files = {n: _peft_dir(n) for n in "ab"}
    a, b = LoRARequest("a", 1, files["a"]), LoRARequest("b", 2, files["b"])
    assert reg.add(a) and reg.add(b) and reg.pin(1)
    replicas[1].missing.add(files["a"])
    replicas[1].kill()
    _wait(lambda: replicas[1].restarts == 1 and replicas[1].health() == "ready")
    state = reg.get("a").stages[0]
    assert (state.state, state.pinned, state.failed_replicas) == ("failed", True, (1,))
    assert state.error.startswith("replica 1: ") and files["a"] in state.error and "\n" not in state.error
    assert reg.get("b").stages[0] == StageState("loaded")
    assert [r.list_loras() for r in replicas] == [{1, 2}, {2}]
    replicas[1].missing.clear()
    assert reg.add(a) is False  # loaded again where it was lost, pinned as it was
    assert (
        reg.get("a").stages[0] == StageState("pinned") and [r.list_loras() for r in replicas] == [{1, 2}] * 2
    )
    runtime.shutdown()
