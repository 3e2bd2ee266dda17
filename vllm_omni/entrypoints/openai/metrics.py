"""The Prometheus series of ``GET /metrics``, pulled from the stages at scrape time.

:class:`OmniCollector` is a prometheus_client collector: each scrape asks ``AsyncOmni`` for every
stage's :class:`~vllm_omni.stats.StageStats` (``stage_stats``: plain data that crossed from the
stage's process or actor) and its health, and turns them into families:

- an LLM stage's own vLLM series, under vLLM's names (``vllm:num_requests_running``,
  ``vllm:e2e_request_latency_seconds``, ...), each sample with a ``stage`` label added;
- ``vllm_omni:`` series per stage (requests, latency, diffusion queue time, seconds per
  denoising step, images, videos) and per adapter (label ``adapter``: the adapter's name).

Every series is listed, with its type, labels and unit, in ``docs/user_guide/metrics.md``
(``SERIES`` below is that list's source; a test keeps them equal).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from vllm_omni.stats import AdapterStats, Histogram, StageStats

#: name -> (type, labels, unit / meaning) of every ``vllm_omni:`` series.
SERIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "vllm_omni:stage_ready": ("gauge", ("stage", "stage_type"), "1 while the stage serves, else 0"),
    "vllm_omni:stage_requests_total": ("counter", ("stage", "stage_type", "status"), "requests"),
    "vllm_omni:stage_request_latency_seconds": (
        "histogram",
        ("stage", "stage_type"),
        "seconds from submission to the stage's output",
    ),
    "vllm_omni:diffusion_queue_time_seconds": ("histogram", ("stage",), "seconds before the batch started"),
    "vllm_omni:diffusion_step_seconds": ("histogram", ("stage",), "seconds per denoising step of a batch"),
    "vllm_omni:diffusion_running_requests": ("gauge", ("stage",), "requests in the denoiser batch now"),
    "vllm_omni:diffusion_step_batch_size": ("histogram", ("stage",), "denoiser samples per step"),
    "vllm_omni:diffusion_images_total": ("counter", ("stage",), "images"),
    "vllm_omni:diffusion_videos_total": ("counter", ("stage",), "videos"),
    "vllm_omni:lora_requests_total": ("counter", ("stage", "adapter"), "requests"),
    "vllm_omni:lora_request_latency_seconds": (
        "histogram",
        ("stage", "adapter"),
        "seconds from submission to the stage's output",
    ),
    "vllm_omni:lora_cache_hits_total": ("counter", ("stage", "adapter"), "requests"),
    "vllm_omni:lora_cache_misses_total": ("counter", ("stage", "adapter"), "requests"),
    "vllm_omni:lora_slot_hits_total": ("counter", ("stage", "adapter"), "denoiser batches"),
    "vllm_omni:lora_slot_misses_total": ("counter", ("stage", "adapter"), "denoiser batches"),
    "vllm_omni:lora_evictions_total": ("counter", ("stage", "adapter"), "evictions"),
    "vllm_omni:lora_load_seconds": ("histogram", ("stage", "adapter"), "seconds per load"),
    "vllm_omni:lora_loaded": ("gauge", ("stage", "adapter"), "1 while in the host cache"),
    "vllm_omni:lora_pinned": ("gauge", ("stage", "adapter"), "1 while pinned"),
    "vllm_omni:lora_registration_failures_total": ("counter", ("stage", "adapter"), "refused add_lora calls"),
}

_HELP = {
    "vllm_omni:stage_ready": "Whether the stage serves (its worker is not restarting or dead).",
    "vllm_omni:stage_requests_total": "Requests that left the stage, by status (ok, error).",
    "vllm_omni:stage_request_latency_seconds": "Seconds from submission to the stage's output.",
    "vllm_omni:diffusion_queue_time_seconds": "Seconds a diffusion request waited for its batch.",
    "vllm_omni:diffusion_step_seconds": "Seconds per denoising step of a diffusion batch.",
    "vllm_omni:diffusion_running_requests": "Requests in a step-batched diffusion stage's denoiser batch.",
    "vllm_omni:diffusion_step_batch_size": "Denoiser samples of each step of a step-batched diffusion stage.",
    "vllm_omni:diffusion_images_total": "Images the diffusion stage produced.",
    "vllm_omni:diffusion_videos_total": "Videos the diffusion stage produced.",
    "vllm_omni:lora_requests_total": "Finished requests that used the adapter.",
    "vllm_omni:lora_request_latency_seconds": "Seconds from submission to output of the adapter's requests.",
    "vllm_omni:lora_cache_hits_total": "Requests that found the adapter in the stage's host cache.",
    "vllm_omni:lora_cache_misses_total": "Requests that had the adapter loaded into the host cache first.",
    "vllm_omni:lora_slot_hits_total": "Denoiser batches that found the adapter in a device slot.",
    "vllm_omni:lora_slot_misses_total": "Denoiser batches that wrote the adapter into a device slot.",
    "vllm_omni:lora_evictions_total": "Times the host cache evicted the adapter to make room.",
    "vllm_omni:lora_load_seconds": "Seconds to read and prepare the adapter, per load.",
    "vllm_omni:lora_loaded": "Whether the adapter is in the stage's host cache.",
    "vllm_omni:lora_pinned": "Whether the adapter is pinned in the stage's host cache.",
    "vllm_omni:lora_registration_failures_total": (
        "Adapter registrations refused (stage=server: by the server before any stage saw them)."
    ),
}

#: AdapterStats counter field -> series name.
_ADAPTER_COUNTERS = {
    "requests": "vllm_omni:lora_requests_total",
    "cache_hits": "vllm_omni:lora_cache_hits_total",
    "cache_misses": "vllm_omni:lora_cache_misses_total",
    "slot_hits": "vllm_omni:lora_slot_hits_total",
    "slot_misses": "vllm_omni:lora_slot_misses_total",
    "evictions": "vllm_omni:lora_evictions_total",
    "registration_failures": "vllm_omni:lora_registration_failures_total",
}


class RegistrationFailures:
    """Adapter registrations the server refused before calling the engine (name clash, refused
    path), by adapter name; exported with ``stage="server"``. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def note(self, adapter: str) -> None:
        with self._lock:
            self._counts[adapter] = self._counts.get(adapter, 0) + 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def _family(name: str) -> Any:
    kind, labels, _ = SERIES[name]
    cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[
        kind
    ]
    return cls(name.removesuffix("_total") if kind == "counter" else name, _HELP[name], labels=list(labels))


def _add_histogram(family: HistogramMetricFamily, labels: list[str], hist: Histogram) -> None:
    family.add_metric(labels, hist.cumulative(), hist.total)


class OmniCollector:
    """Collects every series of ``/metrics`` at scrape time (see the module docstring).

    Args:
        omni: the running ``AsyncOmni`` (``stage_stats``, ``stage_health``, ``config``).
        failures: the server's own registration refusals.
        served_name: the served model name: vLLM's ``model_name`` label takes it (as with
            ``vllm serve``) instead of the stage's model path.
        timeout: seconds a stage may take to answer a scrape (``None`` for that stage after it).
    """

    def __init__(
        self, omni: Any, failures: RegistrationFailures, served_name: str | None = None, timeout: float = 5.0
    ) -> None:
        self.omni = omni
        self.failures = failures
        self.served_name = served_name
        self.timeout = timeout

    def collect(self) -> Iterator[Metric]:
        stats: dict[int, StageStats | None] = self.omni.stage_stats(self.timeout)
        health = self.omni.stage_health()
        types = {s.stage_id: s.stage_type for s in self.omni.config.stages}
        families = {name: _family(name) for name in SERIES}
        for stage_id, stage_type in types.items():
            families["vllm_omni:stage_ready"].add_metric(
                [str(stage_id), stage_type], float(health.get(stage_id) == "ready")
            )
        for stage_id, snap in stats.items():
            if snap is not None:
                self._stage(families, str(stage_id), snap)
        for adapter, n in self.failures.counts().items():
            families["vllm_omni:lora_registration_failures_total"].add_metric(["server", adapter], n)
        yield from families.values()
        yield from _vllm_families([snap for snap in stats.values() if snap is not None], self.served_name)

    @staticmethod
    def _stage(families: dict[str, Any], stage: str, snap: StageStats) -> None:
        requests = families["vllm_omni:stage_requests_total"]
        requests.add_metric([stage, snap.kind, "ok"], snap.requests)
        requests.add_metric([stage, snap.kind, "error"], snap.failed)
        _add_histogram(families["vllm_omni:stage_request_latency_seconds"], [stage, snap.kind], snap.latency)
        if snap.kind == "diffusion":
            _add_histogram(families["vllm_omni:diffusion_queue_time_seconds"], [stage], snap.queue)
            _add_histogram(families["vllm_omni:diffusion_step_seconds"], [stage], snap.step)
            families["vllm_omni:diffusion_running_requests"].add_metric([stage], snap.running)
            _add_histogram(families["vllm_omni:diffusion_step_batch_size"], [stage], snap.step_batch)
            families["vllm_omni:diffusion_images_total"].add_metric([stage], snap.images)
            families["vllm_omni:diffusion_videos_total"].add_metric([stage], snap.videos)
        for name, adapter in sorted(snap.adapters.items()):
            _adapter(families, [stage, name], adapter)


def _adapter(families: dict[str, Any], labels: list[str], a: AdapterStats) -> None:
    for field_name, series in _ADAPTER_COUNTERS.items():
        families[series].add_metric(labels, getattr(a, field_name))
    _add_histogram(families["vllm_omni:lora_request_latency_seconds"], labels, a.latency)
    _add_histogram(families["vllm_omni:lora_load_seconds"], labels, a.load)
    families["vllm_omni:lora_loaded"].add_metric(labels, float(a.loaded))
    families["vllm_omni:lora_pinned"].add_metric(labels, float(a.pinned))


def _vllm_families(snaps: list[StageStats], served_name: str | None) -> Iterator[Metric]:
    """The stages' vLLM families, one per name, with label ``stage`` added to every sample (and
    ``model_name``, where present, set to ``served_name``)."""
    merged: dict[str, Metric] = {}
    for snap in snaps:
        for fam in snap.vllm:
            metric = merged.get(fam.name)
            if metric is None:
                metric = merged[fam.name] = Metric(fam.name, fam.help, fam.kind)
            for sample, labels, value in fam.samples:
                labels = {**labels, "stage": str(snap.stage_id)}
                if served_name is not None and "model_name" in labels:
                    labels["model_name"] = served_name
                metric.add_sample(sample, labels, value)
    yield from merged.values()


def metrics_registry(
    omni: Any, failures: RegistrationFailures, served_name: str | None = None
) -> CollectorRegistry:
    """The registry ``/metrics`` renders: :class:`OmniCollector` plus the process, platform and
    garbage-collector series ``vllm serve`` also exports (``process_*``, ``python_*``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(OmniCollector(omni, failures, served_name))
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


__all__ = ["OmniCollector", "RegistrationFailures", "SERIES", "metrics_registry"]
