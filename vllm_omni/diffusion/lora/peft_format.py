"""PEFT configuration rules for diffusion adapters: per-module scaling and target selection.

The configuration itself is read by :mod:`vllm_omni.lora.adapter_files` (peft's ``LoraConfig``, with the
refusals shared by every gate); this module applies it to the ``(A, B)`` pairs of a diffusion adapter.
Rules (facts of peft's ``LoraConfig``, see its documentation):

* scaling ``s = lora_alpha / r``; with ``use_rslora`` ``s = lora_alpha / sqrt(r)``;
* ``rank_pattern`` / ``alpha_pattern`` override ``r`` / ``lora_alpha`` for modules whose name ends
  with the pattern (peft's ``get_pattern_key``: the first matching pattern wins);
* ``target_modules`` (full-match regex string, list of names / suffixes, or ``"all-linear"``),
  ``exclude_modules`` and ``layers_to_transform`` are applied with peft's ``check_target_module_exists``;
  stored tensors for modules they do not select are refused (peft would ignore them).

The readers that use it are in :mod:`.safetensors_format`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from peft.tuners.tuners_utils import check_target_module_exists

from vllm_omni.diffusion.lora.adapter import LoRAModuleWeights, candidate_module_keys, lora_scaling
from vllm_omni.errors import LoRAFormatError
from vllm_omni.lora.adapter_files import declared_rank_alpha


def untargeted_modules(config: object, module_keys: Iterable[str]) -> list[str]:
    """Module keys that peft's ``target_modules`` / ``exclude_modules`` / ``layers_to_transform`` rules
    (peft's own ``check_target_module_exists``; a string is a full-match regex, a list matches names
    or dotted suffixes) would not give a LoRA layer; peft would ignore their tensors.

    ``"all-linear"`` targets every linear layer, which binding checks, so only exclusions apply.
    Keys are tried with and without their wrapper prefixes (``base_model.model.`` ...).
    """
    target_modules = getattr(config, "target_modules", None)
    if target_modules is None:
        return []
    missing = []
    for key in module_keys:
        candidates = candidate_module_keys(key)
        if isinstance(target_modules, str) and target_modules == "all-linear":
            probe = [dataclasses.replace(config, target_modules={c}) for c in candidates]
            hit = any(
                check_target_module_exists(p, c) is True for p, c in zip(probe, candidates, strict=True)
            )
        else:
            hit = any(_is_targeted(check_target_module_exists(config, c)) for c in candidates)
        if not hit:
            missing.append(key)
    return missing


def _is_targeted(result: object) -> bool:
    # peft returns True, a re.Match, False/None, or an "excluded" marker object
    return result is True or isinstance(result, re.Match)


def build_module_weights(
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    config: Any | None,
    module_alphas: Mapping[str, float] | None,
    source: str,
) -> dict[str, LoRAModuleWeights]:
    """Attach a scaling to each ``(A, B)`` pair following peft's rules.

    Args:
        pairs: module key -> ``(A [r, d_in], B [d_out, r])``.
        config: the adapter's peft ``LoraConfig``, or ``None`` (no configuration shipped).
        module_alphas: per-module alpha tensors (kohya ``.alpha``), which take precedence.
        source: file name for messages.

    The rank used for scaling is the tensor rank; when the configuration declares a rank for the
    module (``rank_pattern`` entry, else ``r``) it must agree. ``alpha`` comes from, in order: a
    per-module alpha tensor, the configuration (``alpha_pattern``, else ``lora_alpha``), else the rank
    (``s = 1``, the convention of alpha-less exports). Patterns are matched against the module key
    without wrapper prefixes (what peft sees inside the base model).

    Raises:
        LoRAFormatError: declared and stored ranks differ (both named); an alpha of 0 or not finite.
    """
    use_rslora = bool(getattr(config, "use_rslora", False))
    modules: dict[str, LoRAModuleWeights] = {}
    for key, (lora_a, lora_b) in pairs.items():
        tensor_rank = int(lora_a.shape[0])
        alpha: float = tensor_rank
        if config is not None:
            declared, alpha = declared_rank_alpha(config, candidate_module_keys(key)[-1])
            if declared != tensor_rank:
                raise LoRAFormatError(
                    f"{source}: module {key!r} stores rank {tensor_rank} but the config declares rank {declared}"
                )
        if module_alphas and key in module_alphas:
            alpha = module_alphas[key]
        if not math.isfinite(float(alpha)) or float(alpha) == 0.0:
            raise LoRAFormatError(
                f"{source}: module {key!r} has alpha {alpha!r}, which makes its scaling alpha / r "
                f"{'zero (the adapter would change nothing)' if float(alpha) == 0.0 else 'not finite'}"
            )
        modules[key] = LoRAModuleWeights(lora_a, lora_b, lora_scaling(alpha, tensor_rank, use_rslora))
    return modules
