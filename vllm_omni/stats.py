"""Statistics of a running stage as plain data: what ``/metrics`` exports, gathered where it happens.

A stage runtime (in the server's process, an ``mp`` worker process or a Ray actor) keeps one
:class:`StatsRecorder`; its ``stats()`` call returns a :class:`StageStats` snapshot, a tree of
dataclasses, lists, dicts and numbers only, so it pickles across any process boundary unchanged.
The HTTP layer turns snapshots into Prometheus series at scrape time
(:mod:`vllm_omni.entrypoints.openai.metrics`; the series are listed in ``docs/user_guide/metrics.md``).

Units: seconds for every duration, counts for everything else. Histograms keep
non-cumulative bucket counts (``counts[i]``: observations ``<= buckets[i]`` and above the
previous bound; the last entry: above every bound), their sum and their count.

This module imports nothing but the standard library: every layer may use it.
"""

from __future__ import annotations

import copy
import threading
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: Bucket bounds (seconds) of request latency and queue time histograms.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
#: Bucket bounds (seconds) of per-step and adapter-load histograms.
FAST_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: Bucket bounds (denoiser samples) of the per-step batch size histogram.
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class Histogram:
    """Observations of one duration (seconds); see the module docstring for the bucket layout."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def add(self, other: Histogram) -> None:
        """Add ``other``'s observations (same buckets) to this one."""
        if other.buckets != self.buckets:
            raise ValueError(f"histograms with different buckets: {self.buckets} vs {other.buckets}")
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total
        self.count += other.count

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(upper bound as Prometheus writes it, cumulative count)]``, ``"+Inf"`` last."""
        out, running = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += n
            out.append((bound, running))
        return out


@dataclass
class AdapterStats:
    """One adapter on one stage (``name``: its ``lora_name``).

    Attributes:
        requests: finished requests that used the adapter (a request composing two adapters
            counts for both); ``latency``: their seconds from submission to the stage's output.
        cache_hits / cache_misses: a request found the adapter in the stage's host cache /
            had it loaded first (the engine's adapter cache on an LLM stage).
        slot_hits / slot_misses: a denoiser batch found the adapter in a device slot / wrote it
            into one (diffusion stages; counted once per batch).
        evictions: times the host cache dropped it to make room (LRU; ``remove_lora`` is not one).
        load: seconds to read and prepare the adapter per load (into the host cache).
        loaded / pinned: some version of it is in the host cache now / pinned there (a stage holds
            each version of a name under its own id while an in-place reload swaps them; the name is
            loaded while any version is).
        registration_failures: ``add_lora`` calls for it that this stage refused.
    """

    name: str
    requests: int = 0
    latency: Histogram = field(default_factory=Histogram)
    cache_hits: int = 0
    cache_misses: int = 0
    slot_hits: int = 0
    slot_misses: int = 0
    evictions: int = 0
    load: Histogram = field(default_factory=lambda: Histogram(FAST_BUCKETS))
    loaded: bool = False
    pinned: bool = False
    registration_failures: int = 0

    def add(self, other: AdapterStats) -> None:
        """Add ``other`` (the same adapter on another replica): counts add up, states OR."""
        for name in ("requests", "cache_hits", "cache_misses", "slot_hits", "slot_misses", "evictions"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.registration_failures += other.registration_failures
        self.latency.add(other.latency)
        self.load.add(other.load)
        self.loaded |= other.loaded
        self.pinned |= other.pinned


@dataclass
class MetricFamily:
    """One Prometheus metric family as collected (``kind``: counter, gauge, histogram, ...;
    ``samples``: ``(sample name, labels, value)``), e.g. a vLLM engine's ``vllm:`` series."""

    name: str
    kind: str
    help: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


@dataclass
class StageStats:
    """A snapshot of one stage (all replicas summed).

    Attributes:
        stage_id / kind: the stage and ``"llm"`` or ``"diffusion"``.
        replicas: how many replicas reported.
        requests / failed: finished requests, successful and failed.
        queue: seconds a request waited before its batch started (diffusion stages).
        latency: seconds from submission to the stage's output, every request.
        step: seconds per denoising step of a batch (diffusion stages).
        running: requests in the denoiser batch now (diffusion stages with ``batching="step"``).
        step_batch: denoiser samples (CFG copies included) of each step (``batching="step"``).
        images / videos: images and videos the stage produced.
        adapters: ``{adapter name: AdapterStats}``.
        vllm: the vLLM engine's own metric families (LLM stages; label ``engine`` is the replica).
    """

    stage_id: int
    kind: str
    replicas: int = 1
    requests: int = 0
    failed: int = 0
    queue: Histogram = field(default_factory=Histogram)
    latency: Histogram = field(default_factory=Histogram)
    step: Histogram = field(default_factory=lambda: Histogram(FAST_BUCKETS))
    running: int = 0
    step_batch: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))
    images: int = 0
    videos: int = 0
    adapters: dict[str, AdapterStats] = field(default_factory=dict)
    vllm: list[MetricFamily] = field(default_factory=list)


def merge_replicas(snapshots: Sequence[StageStats], indexes: Sequence[int] | None = None) -> StageStats:
    """One snapshot for a replicated stage: counts and histograms summed, adapter states OR-ed;
    each replica's vLLM families keep their samples with label ``engine`` set to its replica
    index (``indexes[i]`` for ``snapshots[i]``; default: the position)."""
    out = copy.deepcopy(snapshots[0])
    out.vllm = []
    out.replicas = 0
    families: dict[str, MetricFamily] = {}
    for position, snap in enumerate(snapshots):
        index = position if indexes is None else indexes[position]
        out.replicas += snap.replicas
        if position:
            out.requests += snap.requests
            out.failed += snap.failed
            out.images += snap.images
            out.videos += snap.videos
            out.running += snap.running
            for name in ("queue", "latency", "step", "step_batch"):
                getattr(out, name).add(getattr(snap, name))
            for name, adapter in snap.adapters.items():
                if name in out.adapters:
                    out.adapters[name].add(adapter)
                else:
                    out.adapters[name] = copy.deepcopy(adapter)
        for fam in snap.vllm:
            merged = families.setdefault(fam.name, MetricFamily(fam.name, fam.kind, fam.help))
            for sample, labels, value in fam.samples:
                labels = {**labels, "engine": str(index)} if "engine" in labels else labels
                merged.samples.append((sample, labels, value))
    out.vllm = list(families.values())
    return out


_COUNTERS = frozenset(
    {"cache_hits", "cache_misses", "slot_hits", "slot_misses", "evictions", "registration_failures"}
)


class StatsRecorder:
    """The thread-safe accumulator behind a stage runtime's ``stats()`` (see :class:`StageStats`)."""

    def __init__(self, stage_id: int, kind: str) -> None:
        self._lock = threading.Lock()
        self._stats = StageStats(stage_id, kind)
        self._versions: dict[str, dict[int, bool]] = {}  # name -> {engine id held: pinned}

    def _adapter(self, name: str) -> AdapterStats:
        found = self._stats.adapters.get(name)
        if found is None:
            found = self._stats.adapters[name] = AdapterStats(name)
        return found

    def request_done(
        self,
        adapters: Iterable[str],
        seconds: float,
        ok: bool,
        *,
        queued: float | None = None,
        images: int = 0,
        videos: int = 0,
    ) -> None:
        """One request left the stage after ``seconds`` (``queued`` of them before its batch)."""
        with self._lock:
            s = self._stats
            s.requests += ok
            s.failed += not ok
            s.latency.observe(seconds)
            if queued is not None:
                s.queue.observe(queued)
            s.images += images
            s.videos += videos
            if ok:
                for name in dict.fromkeys(adapters):
                    a = self._adapter(name)
                    a.requests += 1
                    a.latency.observe(seconds)

    def running(self, n: int) -> None:
        """``n`` requests run in the denoiser batch now (step-level batching)."""
        with self._lock:
            self._stats.running = int(n)

    def step_batch(self, samples: int) -> None:
        """One denoiser step ran ``samples`` samples (step-level batching)."""
        with self._lock:
            self._stats.step_batch.observe(samples)

    def count(self, name: str, field_name: str, n: int = 1) -> None:
        """Add ``n`` to an :class:`AdapterStats` counter (``cache_hits``, ``slot_misses``, ...)."""
        with self._lock:
            a = self._adapter(name)
            setattr(a, field_name, getattr(a, field_name) + n)

    def loaded(self, name: str, seconds: float | None = None, version: int | None = None) -> None:
        """The adapter is in the host cache now (``seconds``: it was just loaded, in that time;
        ``version``: the engine id it is held under, ``None``: one version per name)."""
        with self._lock:
            a = self._adapter(name)
            held = self._versions.setdefault(name, {})
            held.setdefault(-1 if version is None else version, False)
            a.loaded = True
            if seconds is not None:
                a.load.observe(seconds)

    def unloaded(self, name: str, evicted: bool = False, version: int | None = None) -> None:
        """A version of the adapter left the host cache (``evicted``: to make room, not removed); the
        name stays loaded (and pinned) while another version is (``version=None``: every version left)."""
        with self._lock:
            a = self._adapter(name)
            held = self._versions.setdefault(name, {})
            if version is None:
                held.clear()
            else:
                held.pop(version, None)
            a.loaded, a.pinned = bool(held), any(held.values())
            a.evictions += evicted

    def pinned(self, name: str, version: int | None = None) -> None:
        """A version of the adapter is pinned (``None``: every version held)."""
        with self._lock:
            held = self._versions.setdefault(name, {})
            held.update(dict.fromkeys([version] if version is not None else (held or [-1]), True))
            self._adapter(name).pinned = True

    def apply(self, events: Iterable[tuple]) -> None:
        """Apply a diffusion worker's events ``(event, adapter name, value[, version])``: ``step``
        (seconds of one denoising step), ``loaded`` (load seconds), ``evicted``, ``unloaded``,
        ``pinned`` (``version``: the engine id of the version concerned, as :meth:`loaded`), or the
        name of an :class:`AdapterStats` counter (add ``value``).

        Raises:
            ValueError: an unknown event (nothing after it is applied).
        """
        for event, name, value, *version in events:
            held = version[0] if version else None
            if event == "step":
                with self._lock:
                    self._stats.step.observe(value)
            elif event == "loaded":
                self.loaded(name, value, held)
            elif event in ("evicted", "unloaded"):
                self.unloaded(name, evicted=event == "evicted", version=held)
            elif event == "pinned":
                self.pinned(name, held)
            elif event in _COUNTERS:
                self.count(name, event, int(value))
            else:
                raise ValueError(f"unknown statistics event {event!r}")

    def snapshot(self) -> StageStats:
        """A copy of the statistics so far."""
        with self._lock:
            return copy.deepcopy(self._stats)
