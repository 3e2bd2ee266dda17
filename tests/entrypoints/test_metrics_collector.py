"""The ``/metrics`` collector without a server: snapshots in, Prometheus text out, and the docs page's table.

A fake ``AsyncOmni`` hands the collector fixed :class:`~vllm_omni.stats.StageStats`; the text is read
back with prometheus_client's parser. The recorder and the replica merge are checked on hand-made events.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni.entrypoints.openai.metrics import SERIES, RegistrationFailures, metrics_registry
from vllm_omni.stats import MetricFamily, StatsRecorder, merge_replicas

DOC = Path(__file__).resolve().parents[2] / "docs" / "user_guide" / "metrics.md"


class FakeOmni:
    def __init__(self, stats, health):
        self.stats, self.health = stats, health
        self.config = SimpleNamespace(
            stages=[
                SimpleNamespace(stage_id=0, stage_type="llm_ar"),
                SimpleNamespace(stage_id=1, stage_type="diffusion"),
            ]
        )

    def stage_stats(self, timeout):
        return self.stats

    def stage_health(self):
        return self.health


def samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_snapshots_become_series():
    llm = StatsRecorder(0, "llm_ar")
    llm.request_done(["a"], 0.2, True)
    llm.count("a", "cache_hits")
    llm_snap = llm.snapshot()
    vllm_family = MetricFamily(
        "vllm:num_requests_running",
        "gauge",
        "Running.",
        [("vllm:num_requests_running", {"engine": "0", "model_name": "/models/x"}, 2.0)],
    )
    llm_snap.vllm = [vllm_family]
    img = StatsRecorder(1, "diffusion")
    img.request_done(["warm", "stripes"], 1.5, True, queued=0.25, images=2)
    img.request_done([], 3.0, False, queued=0.5)
    img.apply([("step", "", 0.1), ("step", "", 0.2), ("slot_misses", "warm", 1), ("loaded", "warm", 0.03)])
    img.apply([("evicted", "stripes", 1), ("pinned", "warm", 1)])
    failures = RegistrationFailures()
    failures.note("bad")
    omni = FakeOmni({0: llm_snap, 1: img.snapshot()}, {0: "ready", 1: "restarting"})
    got = samples(generate_latest(metrics_registry(omni, failures, "served")).decode())

    def v(name, **labels):
        return got[(name, tuple(sorted(labels.items())))]

    assert v("vllm:num_requests_running", engine="0", stage="0", model_name="served") == 2
    assert v("vllm_omni:stage_ready", stage="0", stage_type="llm_ar") == 1
    assert v("vllm_omni:stage_ready", stage="1", stage_type="diffusion") == 0
    assert v("vllm_omni:lora_requests_total", stage="0", adapter="a") == 1
    assert v("vllm_omni:lora_cache_hits_total", stage="0", adapter="a") == 1
    assert v("vllm_omni:lora_requests_total", stage="1", adapter="stripes") == 1
    assert v("vllm_omni:stage_requests_total", stage="1", stage_type="diffusion", status="error") == 1
    assert v("vllm_omni:diffusion_images_total", stage="1") == 2
    assert v("vllm_omni:diffusion_queue_time_seconds_sum", stage="1") == pytest.approx(0.75)
    assert v("vllm_omni:diffusion_queue_time_seconds_bucket", stage="1", le="0.25") == 1
    assert v("vllm_omni:diffusion_step_seconds_count", stage="1") == 2
    assert v("vllm_omni:lora_load_seconds_bucket", stage="1", adapter="warm", le="0.05") == 1
    assert v("vllm_omni:lora_loaded", stage="1", adapter="warm") == 1
    assert v("vllm_omni:lora_pinned", stage="1", adapter="warm") == 1
    assert v("vllm_omni:lora_evictions_total", stage="1", adapter="stripes") == 1
    assert v("vllm_omni:lora_loaded", stage="1", adapter="stripes") == 0
    assert v("vllm_omni:lora_slot_misses_total", stage="1", adapter="warm") == 1
    assert v("vllm_omni:lora_registration_failures_total", stage="server", adapter="bad") == 1
    assert not any(
        name.startswith("vllm_omni:diffusion") and dict(labels).get("stage") == "0" for name, labels in got
    )


def test_a_stage_that_does_not_answer_is_left_out():
    omni = FakeOmni({0: None, 1: None}, {0: "restarting", 1: "ready"})
    got = samples(generate_latest(metrics_registry(omni, RegistrationFailures())).decode())
    assert got[("vllm_omni:stage_ready", (("stage", "0"), ("stage_type", "llm_ar")))] == 0
    assert not any(name == "vllm_omni:stage_requests_total" for name, _ in got)


def test_replicas_are_summed_and_keep_their_engine_label():
    snaps = []
    for replica in range(2):
        r = StatsRecorder(0, "llm_ar")
        r.request_done(["a"], 0.1 * (replica + 1), True)
        snap = r.snapshot()
        snap.vllm = [MetricFamily("vllm:x", "gauge", "x", [("vllm:x", {"engine": "0"}, float(replica))])]
        snaps.append(snap)
    merged = merge_replicas(snaps, [0, 3])
    assert merged.replicas == 2 and merged.requests == 2
    assert merged.adapters["a"].requests == 2 and merged.adapters["a"].latency.count == 2
    assert merged.latency.total == pytest.approx(0.3)
    assert [s[1]["engine"] for s in merged.vllm[0].samples] == ["0", "3"]
    assert snaps[0].requests == 1  # the inputs are not changed


def test_unknown_events_are_refused():
    with pytest.raises(ValueError, match="unknown statistics event 'nope'"):
        StatsRecorder(0, "diffusion").apply([("nope", "a", 1)])


def test_the_docs_page_lists_every_series_with_its_type_and_labels():
    rows = re.findall(r"^\| `(vllm_omni:[a-z_]+)` \| (\w+) \| ([^|]+) \|", DOC.read_text(), re.M)
    documented = {name: (kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    assert documented == {name: (kind, labels) for name, (kind, labels, _) in SERIES.items()}


def test_a_name_stays_loaded_and_pinned_while_any_version_is():
    """Issue 35 item 6: an in-place reload loads the new version (its own engine id), pins it, then
    drops the old one; the name's ``lora_loaded`` / ``lora_pinned`` used to fall to 0 at that last
    step. LLM stages call the recorder with versions, diffusion workers send them in their events."""
    llm = StatsRecorder(0, "llm_ar")
    llm.loaded("p", 0.1, version=1)
    llm.pinned("p", 1)
    llm.loaded("p", 0.1, version=7)
    llm.pinned("p", 7)
    llm.unloaded("p", version=1)
    img = StatsRecorder(1, "diffusion")
    img.apply(
        [("loaded", "p", 0.1, 1), ("pinned", "p", 1, 1), ("loaded", "p", 0.1, 7), ("unloaded", "p", 0, 1)]
    )
    assert (llm.snapshot().adapters["p"].loaded, llm.snapshot().adapters["p"].pinned) == (True, True)
    assert (img.snapshot().adapters["p"].loaded, img.snapshot().adapters["p"].pinned) == (True, False)
    llm.unloaded("p", evicted=True, version=7)
    img.apply([("pinned", "p", 1, 7), ("evicted", "p", 1, 7)])
    for snap in (llm.snapshot(), img.snapshot()):
        a = snap.adapters["p"]
        assert (a.loaded, a.pinned, a.evictions, a.load.count) == (False, False, 1, 2)


def test_vllm_adapter_lists_name_adapters_as_clients_do():
    """Issue 35 item 6: vLLM's ``vllm:lora_requests_info`` lists the names an LLM stage gave vLLM
    (``"<name>@<engine id>"``); the stage reports clients' names, two versions of one name as one, and
    one sample (the latest) per resulting label set."""
    from vllm_omni.engine.vllm_adapter_names import public_adapter_name, vllm_lora_request
    from vllm_omni.engine.vllm_stats import public_lora_families
    from vllm_omni.lora.request import LoRARequest

    for name in ("p", "a@b", "v@2", "x@"):
        assert public_adapter_name(vllm_lora_request(LoRARequest(name, 9, "/x")).lora_name) == name
    info = "vllm:lora_requests_info"
    labels = {"max_lora": "2", "waiting_lora_adapters": ""}
    fam = MetricFamily(info, "gauge", "h", [
        (info, {**labels, "running_lora_adapters": "p@1,v@2@3"}, 10.0),
        (info, {**labels, "running_lora_adapters": "p@4,v@2@3"}, 12.0),
        (info, {**labels, "running_lora_adapters": "p@1,p@4"}, 11.0),
        (info, {**labels, "running_lora_adapters": ""}, 13.0),
    ])  # fmt: skip
    other = MetricFamily("vllm:x", "gauge", "x", [("vllm:x", {"running_lora_adapters": "p@1"}, 1.0)])
    out = public_lora_families([fam, other])
    assert out[1] is other and fam.samples[0][1]["running_lora_adapters"] == "p@1,v@2@3"
    got = {s[1]["running_lora_adapters"]: s[2] for s in out[0].samples}
    assert got == {"p,v@2": 12.0, "p": 11.0, "": 13.0} and len(out[0].samples) == 3
