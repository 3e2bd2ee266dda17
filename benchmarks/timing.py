"""Timing helpers shared by the benchmarks: a CPU-time / wall-clock timer, interleaved paired
measurements, a peak-RSS sampler and an in-situ profile of the LoRA ops of a diffusion step."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time


class Timer:
    """Seconds spent in ``fn``: wall clock (CUDA: after a device sync) or this process's CPU time.

    On a shared CPU box the wall clock mostly measures the neighbours; with one intra-op thread the
    process CPU time is the work done by this benchmark alone.
    """

    def __init__(self, device: str, clock: str):
        import torch

        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.now = time.process_time if clock == "cpu" else time.perf_counter

    def __call__(self, fn) -> float:
        self.sync()
        t0 = self.now()
        fn()
        self.sync()
        return self.now() - t0


def median(xs) -> float:
    return statistics.median(xs)


def interleaved_medians(fns, rounds: int) -> list[float]:
    """Median wall seconds of each of ``fns``, timed in turn within every round (a loaded machine
    slows all alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, acc in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(acc) for acc in times]


def paired(timer: Timer, sides: dict, repeats: int, warm_base: bool, settle: int = 0) -> dict:
    """Per side, interleaved no-LoRA / LoRA steps; all sides take turns inside each repeat.

    ``sides`` maps a name to ``(step_fn, prepare_base, prepare_lora)``. Interleaving both the two
    conditions and the two sides means a change in the machine's load hits every number alike.
    ``settle`` untimed steps run after each prepare, so that the timed step is one of a request
    that keeps its adapters (caches warm, the graph variant already selected), not the first step
    after a switch.
    Returns per side the medians of the times, the median of the per-pair ratios (``ratio``) and the
    ratio of the fastest runs (``ratio_min``, the least disturbed ones).
    """
    for step, prepare_base, prepare_lora in sides.values():
        prepare_lora()
        step()
        if warm_base:
            prepare_base()
            step()
    tb = {name: [] for name in sides}
    tl = {name: [] for name in sides}
    for _ in range(repeats):
        for name, (step, prepare_base, prepare_lora) in sides.items():
            prepare_base()
            for _ in range(settle):
                step()
            tb[name].append(timer(step))
            prepare_lora()
            for _ in range(settle):
                step()
            tl[name].append(timer(step))
    return {
        name: {
            "base_s": median(tb[name]),
            "lora_s": median(tl[name]),
            "ratio": median([lo / b for lo, b in zip(tl[name], tb[name], strict=True)]),
            "ratio_min": min(tl[name]) / min(tb[name]),
            "base_samples_s": tb[name],
            "lora_samples_s": tl[name],
        }
        for name in sides
    }


def trim_heap() -> None:
    """Return freed malloc memory to the OS (glibc ``malloc_trim``; a no-op elsewhere)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(name).malloc_trim(0)


class PeakRSS:
    """Peak resident set size sampled every 2 ms while inside the block."""

    def __enter__(self):
        import psutil

        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.end = self.proc.memory_info().rss
        self.peak = max(self.peak, self.end)


def lora_op_share(step, wrapper_types, repeats: int = 2) -> dict:
    """Profile ``step`` (torch.profiler, CPU) and split the patched layers' time into base and LoRA.

    Every forward of a LoRA wrapper with an active adapter is recorded as ``lora::layer`` and the
    LoRA part inside it (``apply_lora``: shrink + expand) as ``lora::delta``. Unlike the step-time
    ratio, which on a shared machine scatters by several percent from step to step, this measures
    the LoRA kernels in place, in the same step; it does not see secondary effects (caches).

    Returns:
        seconds per step of the step, the patched layers and their LoRA part; ``lora_over_base``
        (LoRA time / base time of the patched layers, comparable to the FLOP floor) and
        ``lora_over_step``.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    from vllm_omni.diffusion.lora.layers import BaseLayerWithLoRA

    classes = {*wrapper_types, BaseLayerWithLoRA}
    saved = {
        cls: {k: cls.__dict__[k] for k in ("forward", "apply_lora") if k in cls.__dict__} for cls in classes
    }
    forwards = {cls: cls.forward for cls in wrapper_types}  # resolved before anything is patched
    apply = BaseLayerWithLoRA.apply_lora

    def app(self, x, y):
        with record_function("lora::delta"):
            return apply(self, x, y)

    for cls, forward in forwards.items():

        def fwd(self, x, _forward=forward):
            if not self.has_active_lora():
                return _forward(self, x)
            with record_function("lora::layer"):
                return _forward(self, x)

        cls.forward = fwd
    BaseLayerWithLoRA.apply_lora = app
    try:
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                step()
    finally:
        for cls, own in saved.items():
            for name in ("forward", "apply_lora"):
                if name in own:
                    setattr(cls, name, own[name])
                elif name in cls.__dict__:
                    delattr(cls, name)
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    step_us = sum(e.self_cpu_time_total for e in prof.key_averages())
    layer, delta = totals.get("lora::layer", 0.0), totals.get("lora::delta", 0.0)
    return {
        "step_s": step_us / repeats / 1e6,
        "patched_s": layer / repeats / 1e6,
        "lora_s": delta / repeats / 1e6,
        "lora_over_base": delta / max(layer - delta, 1e-9),
        "lora_over_step": delta / max(step_us, 1e-9),
    }
