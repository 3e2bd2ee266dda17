"""ReplicatedStageRuntime over fake runtimes: dispatch, all-or-nothing adapter calls, shutdown.

The fakes keep an adapter cache like the real runtimes (``add_lora`` True when new, ``pin_lora``
fails for an adapter that is not loaded) and can be told to fail a call, so every rollback path
runs without an engine. tests/diffusion/test_diffusion_replicas.py runs real diffusion replicas.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future

import pytest

from vllm_omni.config.stage_config import make_stage_config
from vllm_omni.engine.protocols import StageDescription, StageRuntime
from vllm_omni.engine.replicas import ReplicatedStageRuntime
from vllm_omni.engine.stage_factory import make_stage_runtime
from vllm_omni.errors import (
    AdapterRestoreError,
    InvalidAdapterError,
    InvalidRequestError,
    LoRACacheError,
    StageEngineError,
)
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest, RequestAdapters
from vllm_omni.stats import MetricFamily, StatsRecorder


class FakeRuntime:
    def __init__(self, stage, index=0):
        self.stage = stage
        self.index = index
        self.submitted: list[Future] = []
        self.loras: dict[int, bool] = {}  # id -> pinned
        self.fail: dict[str, Exception] = {}
        self.holds = 0
        self.stopped_with: list = []
        self.stop_barrier: threading.Barrier | None = None
        self.refuse: Exception | None = None
        self.state = "ready"

    def submit(self, request):
        if self.refuse is not None:
            raise self.refuse
        fut: Future = Future()
        fut.prompt = request.prompt
        self.submitted.append(fut)
        return fut

    def validate_request(self, request):
        if request.prompt == "bad":
            raise InvalidRequestError("bad prompt")

    def prepare_params(self, params):
        return ("prepared", params)

    @contextlib.contextmanager
    def hold(self):
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1

    def _maybe_fail(self, method):
        if method in self.fail:
            raise self.fail[method]

    def add_lora(self, req):
        self._maybe_fail("add_lora")
        new = req.lora_int_id not in self.loras
        self.loras.setdefault(req.lora_int_id, False)
        return new

    def remove_lora(self, lora_int_id):
        self._maybe_fail("remove_lora")
        return self.loras.pop(lora_int_id, None) is not None

    def list_loras(self):
        return set(self.loras)

    def pin_lora(self, lora_int_id):
        self._maybe_fail("pin_lora")
        if lora_int_id not in self.loras:
            raise InvalidRequestError(f"cannot pin LoRA {lora_int_id}: it is not loaded")
        self.loras[lora_int_id] = True
        return True

    def health(self):
        return self.state

    def describe(self):
        return StageDescription(
            self.stage.stage_id, f"replica {self.index}", "text", frozenset({"text"}), object
        )

    def stats(self):
        if self.state != "ready":
            raise StageEngineError(f"replica {self.index} is {self.state}")
        recorder = StatsRecorder(self.stage.stage_id, self.stage.stage_type)
        recorder.request_done(["a"], 0.1 * (self.index + 1), True)
        snap = recorder.snapshot()
        snap.vllm = [MetricFamily("vllm:x", "gauge", "x", [("vllm:x", {"engine": "0"}, float(self.index))])]
        return snap

    def shutdown(self, timeout=None):
        self.stopped_with.append(timeout)
        if self.stop_barrier is not None:  # passes only once every replica's shutdown has started
            self.stop_barrier.wait()


@pytest.fixture
def stage():
    return make_stage_config(stage_id=0, stage_type="llm_ar", model="m", replicas=3)


@pytest.fixture
def rep(stage):
    return ReplicatedStageRuntime(stage, [FakeRuntime(stage, i) for i in range(3)])


def _req(i):
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


def test_fake_follows_the_protocol(stage, rep):
    assert isinstance(FakeRuntime(stage), StageRuntime)
    assert isinstance(rep, StageRuntime)


def test_replicas_describe_as_their_first_replica(rep):
    assert rep.describe() == rep.runtimes[0].describe()
    assert rep.describe().label == "replica 0"


def test_stats_sum_the_replicas_that_answer(rep):
    rep.runtimes[1].state = "restarting"
    snap = rep.stats()
    assert (snap.replicas, snap.requests, snap.adapters["a"].requests) == (2, 2, 2)
    assert snap.latency.total == pytest.approx(0.1 + 0.3)
    assert [labels["engine"] for _, labels, _ in snap.vllm[0].samples] == ["0", "2"]  # replica indexes
    for runtime in rep.runtimes:
        runtime.state = "dead"
    with pytest.raises(StageEngineError, match="replica 0 is dead"):
        rep.stats()


def test_least_loaded_dispatch_with_round_robin_ties(rep):
    futures = [rep.submit(StageRequest(f"p{i}")) for i in range(6)]  # all idle: 0 1 2 0 1 2
    assert [len(r.submitted) for r in rep.runtimes] == [2, 2, 2]
    assert rep.in_flight() == [2, 2, 2]
    assert [f.prompt for f in rep.runtimes[1].submitted] == ["p1", "p4"]
    for fut in rep.runtimes[2].submitted:  # replica 2 drains: the next two requests go there
        fut.set_result("done")
    assert rep.in_flight() == [2, 2, 0]
    rep.submit(StageRequest("p6"))
    rep.submit(StageRequest("p7"))
    assert [len(r.submitted) for r in rep.runtimes] == [2, 2, 4]
    rep.runtimes[0].submitted[0].set_exception(RuntimeError("x"))  # a failed request counts as done too
    rep.runtimes[0].submitted[1].cancel()
    assert rep.in_flight() == [0, 2, 2]
    rep.submit(StageRequest("p8"))
    assert len(rep.runtimes[0].submitted) == 3
    assert all(isinstance(f, Future) for f in futures)


def test_concurrent_submits_stay_balanced(rep):
    def burst():
        for i in range(50):
            rep.submit(StageRequest(i))

    threads = [threading.Thread(target=burst) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = [len(r.submitted) for r in rep.runtimes]
    assert sum(counts) == 200 and max(counts) - min(counts) <= 1
    assert rep.in_flight() == counts


def test_dead_replica_is_skipped_user_errors_are_not(rep):
    rep.runtimes[0].refuse = StageEngineError("replica 0 is dead")
    rep.submit(StageRequest("p"))
    rep.submit(StageRequest("q"))
    assert [len(r.submitted) for r in rep.runtimes] == [0, 1, 1]
    assert rep.in_flight() == [0, 1, 1]
    for r in rep.runtimes:
        r.refuse = StageEngineError("all dead")
    with pytest.raises(StageEngineError, match="all dead"):
        rep.submit(StageRequest("p"))
    assert rep.in_flight() == [0, 1, 1]
    rep.runtimes[1].refuse = InvalidRequestError("bad")
    rep.runtimes[2].refuse = None
    rep._next = 1
    with pytest.raises(InvalidRequestError):
        rep.submit(StageRequest("p"))
    assert [len(r.submitted) for r in rep.runtimes] == [0, 1, 1]  # not retried elsewhere


def test_validate_prepare_hold(rep):
    with pytest.raises(InvalidRequestError):
        rep.validate_request(StageRequest("bad"))
    assert rep.prepare_params(1) == ("prepared", 1)
    with rep.hold():
        assert [r.holds for r in rep.runtimes] == [1, 1, 1]
    assert [r.holds for r in rep.runtimes] == [0, 0, 0]


def test_add_lora_reaches_every_replica(rep):
    assert rep.add_lora(_req(1)) is True
    assert rep.add_lora(_req(1)) is False
    assert rep.list_loras() == {1}
    assert rep.pin_lora(1) is True
    assert [r.loras for r in rep.runtimes] == [{1: True}] * 3
    assert rep.remove_lora(1) is True
    assert rep.remove_lora(1) is False
    assert rep.list_loras() == set()


def test_add_lora_rolls_back_on_one_failure(rep):
    rep.add_lora(_req(1))
    before = [dict(r.loras) for r in rep.runtimes]
    rep.runtimes[2].fail["add_lora"] = InvalidAdapterError("rank 512 > max_lora_rank")
    with pytest.raises(
        InvalidAdapterError, match=r"replica 2 of 3: add_lora failed \(rolled back on replica\(s\) \[0, 1\]\)"
    ):
        rep.add_lora(_req(2))
    assert [r.loras for r in rep.runtimes] == before
    assert rep.list_loras() == {1}
    # an adapter some replicas already held stays there (it was not new on them)
    rep.runtimes[0].loras[3] = False
    with pytest.raises(InvalidAdapterError) as info:
        rep.add_lora(_req(3))
    assert isinstance(info.value, ValueError)  # still the user-error type the caller classifies
    assert [set(r.loras) for r in rep.runtimes] == [{1, 3}, {1}, {1}]


def test_failure_on_first_replica_changes_nothing(rep):
    rep.runtimes[0].fail["add_lora"] = LoRACacheError("cache full")
    with pytest.raises(
        LoRACacheError, match=r"replica 0 of 3: add_lora failed \(no replica was changed\): cache full"
    ):
        rep.add_lora(_req(1))
    assert all(not r.loras for r in rep.runtimes)


def test_remove_lora_rolls_back_with_pins(rep):
    rep.add_lora(_req(1))
    rep.pin_lora(1)
    rep.runtimes[1].fail["remove_lora"] = LoRACacheError("in use")
    with pytest.raises(LoRACacheError, match="replica 1 of 3: remove_lora failed"):
        rep.remove_lora(1)
    assert [r.loras for r in rep.runtimes] == [{1: True}] * 3  # replica 0 got it back, pinned
    assert rep.list_loras() == {1}


def test_remove_rollback_of_an_unknown_adapter_is_reported(rep):
    for r in rep.runtimes:  # e.g. a start-up adapter: loaded by the runtimes themselves
        r.loras[7] = False
    rep.runtimes[2].fail["remove_lora"] = LoRACacheError("in use")
    with pytest.raises(LoRACacheError, match=r"rollback FAILED on replica\(s\) \[0, 1\]"):
        rep.remove_lora(7)


def test_pin_lora_rolls_back(rep):
    rep.add_lora(_req(1))
    rep.runtimes[2].fail["pin_lora"] = LoRACacheError("boom")
    with pytest.raises(LoRACacheError, match="replica 2 of 3: pin_lora failed"):
        rep.pin_lora(1)
    assert [r.loras for r in rep.runtimes] == [{1: False}] * 3  # nobody stays pinned
    del rep.runtimes[2].fail["pin_lora"]
    rep.pin_lora(1)
    assert [r.loras for r in rep.runtimes] == [{1: True}] * 3


def test_list_loras_common_set_and_disagreement(rep):
    rep.add_lora(_req(1))
    rep.runtimes[0].loras[5] = False  # a request loaded adapter 5 on replica 0 only
    assert rep.list_loras() == {1}
    rep.pin_lora(1)
    del rep.runtimes[1].loras[1]  # a replica lost a pinned adapter
    with pytest.raises(
        StageEngineError, match=r"replicas disagree.*replica 1: \[1\].*\[\[1, 5\], \[\], \[1\]\]"
    ):
        rep.list_loras()


def test_shutdown_runs_replicas_at_once_within_the_timeout(rep):
    # each replica's shutdown blocks until all three have started: one at a time never gets there
    # (a progress check, not a timing one: the barrier's cap only bounds a failing run)
    barrier = threading.Barrier(len(rep.runtimes), timeout=120)
    for r in rep.runtimes:
        r.stop_barrier = barrier
    rep.shutdown(timeout=300.0)
    assert not barrier.broken, "the replicas were not shut down at once"
    assert all(len(r.stopped_with) == 1 and 0 < r.stopped_with[0] <= 300.0 for r in rep.runtimes)
    with pytest.raises(StageEngineError, match="shut down"):
        rep.submit(StageRequest("p"))
    rep.shutdown()  # idempotent at this level: each runtime's own shutdown is


def test_make_stage_runtime_builds_each_replica_with_make_one():
    stage = make_stage_config(stage_id=0, stage_type="llm_ar", model="m", replicas=2, devices="cuda:0,cuda:1")
    made = []

    def make_one(s, index):
        made.append(index)
        return FakeRuntime(s, index)

    runtime = make_stage_runtime(stage, make_one=make_one)
    assert isinstance(runtime, ReplicatedStageRuntime) and made == [0, 1]
    single = make_stage_config(stage_id=0, stage_type="llm_ar", model="m")
    assert isinstance(make_stage_runtime(single, make_one=make_one), FakeRuntime)


def test_a_replica_that_fails_to_start_stops_the_others():
    stage = make_stage_config(stage_id=0, stage_type="llm_ar", model="m", replicas=3)
    started = []

    def make_one(s, index):
        if index == 2:
            raise StageEngineError("replica 2 could not start")
        started.append(FakeRuntime(s, index))
        return started[-1]

    with pytest.raises(StageEngineError, match="could not start"):
        make_stage_runtime(stage, make_one=make_one)
    assert [len(r.stopped_with) for r in started] == [1, 1]


def test_health_is_ready_while_any_replica_is(stage):
    fakes = [FakeRuntime(stage, i) for i in range(3)]
    runtime = ReplicatedStageRuntime(stage, fakes)
    assert runtime.health() == "ready"
    fakes[0].state, fakes[1].state = "dead", "restarting"
    assert runtime.health() == "ready"
    fakes[2].state = "dead"
    assert runtime.health() == "restarting"
    fakes[1].state = "dead"
    assert runtime.health() == "dead"


def test_a_replica_that_lost_the_adapter_in_a_restart_is_skipped(stage):
    """Issue 21 rule 4 per replica: the replica whose restart could not restore an adapter refuses
    requests naming it (``AdapterRestoreError``); another replica that holds it serves them, and the
    stage lists the loss naming the replica."""
    fakes = [FakeRuntime(stage, i) for i in range(3)]
    runtime = ReplicatedStageRuntime(stage, fakes)
    lost = AdapterRestoreError("Stage 0 (llm_ar): adapter 'a1' (id 1) could not be restored: /adapters/a1")
    fakes[0].refuse = lost
    fakes[0].failed_loras = lambda: {1: str(lost)}
    runtime.submit(StageRequest("p", adapters=RequestAdapters.of(_req(1))))
    assert [len(r.submitted) for r in fakes] == [0, 1, 0]
    assert runtime.failed_loras() == {1: f"replica 0: {lost}"}
    for fake in fakes:
        fake.refuse = lost
    with pytest.raises(AdapterRestoreError, match="/adapters/a1"):
        runtime.submit(StageRequest("p", adapters=RequestAdapters.of(_req(1))))
    fakes[1].state, fakes[2].state = "starting", "dead"
    fakes[0].state = "dead"
    assert runtime.health() == "starting"
