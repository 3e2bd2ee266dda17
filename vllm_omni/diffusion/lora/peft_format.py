"""PEFT-format adapters: a directory with ``adapter_config.json`` and ``adapter_model.safetensors``.

The configuration is read with peft's own ``PeftConfig.from_pretrained`` (so every field is
interpreted exactly as peft interprets it); tensors are read with safetensors. The result is a
format-neutral :class:`~.adapter.LoRAAdapterWeights`.

Rules (facts of peft's ``LoraConfig``, see its documentation):

* scaling ``s = lora_alpha / r``; with ``use_rslora`` ``s = lora_alpha / sqrt(r)``;
* ``rank_pattern`` / ``alpha_pattern`` override ``r`` / ``lora_alpha`` for modules whose name ends
  with the pattern (a regular expression matched as ``(.*\\.)?(<pattern>)$``); the first matching
  pattern in the dict wins;
* tensors are saved as ``base_model.model.<module>.lora_A.weight`` / ``...lora_B.weight``.

Unsupported features are rejected with :class:`~.adapter.LoRAFormatError` instead of being ignored:
DoRA (``use_dora`` or ``lora_magnitude_vector`` tensors), ``modules_to_save``, LoRA bias, trainable
tokens, layer replication, parameter targeting, embedding / convolution LoRA, and non-LoRA PEFT types.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

from vllm_omni.diffusion.lora.adapter import (
    LoRAAdapterWeights,
    LoRAFormatError,
    LoRAModuleWeights,
    check_pair,
    lora_scaling,
)

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"

# "<module>.lora_A.weight" or "<module>.lora_A.<adapter name>.weight"
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")
_ALPHA_KEY = re.compile(r"^(?P<module>.+)\.alpha$")

# Config fields whose non-default value changes the math in ways this runtime does not implement.
_UNSUPPORTED_FIELDS: tuple[tuple[str, str], ...] = (
    ("use_dora", "DoRA (weight-decomposed LoRA) needs magnitude vectors and a norm per forward"),
    ("modules_to_save", "modules_to_save replaces whole modules, which request-time LoRA cannot swap"),
    ("lora_bias", "LoRA bias terms are not supported"),
    ("trainable_token_indices", "trainable token embeddings are not supported"),
    ("layer_replication", "layer replication is not supported"),
    ("target_parameters", "LoRA on raw parameters (target_parameters) is not supported"),
    ("use_qalora", "QA-LoRA is not supported"),
    ("use_bdlora", "block-diagonal LoRA is not supported"),
    ("alora_invocation_tokens", "activated LoRA (aLoRA) is not supported"),
)


def match_pattern_key(patterns: Mapping[str, object], module_key: str) -> str | None:
    """First key of ``patterns`` that matches ``module_key`` the way peft's rank/alpha patterns do.

    A pattern ``p`` matches when ``re.match(r"(.*\\.)?(p)$", module_key)`` succeeds, i.e. the
    module name ends with ``p`` on a dot boundary (``p`` may itself be a regular expression).
    """
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return pattern
    return None


def split_lora_state_dict(
    state_dict: Mapping[str, torch.Tensor], source: str, *, allow_alpha_keys: bool = False
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float]]:
    """Group PEFT/diffusers-style LoRA tensors by module.

    Args:
        state_dict: key -> tensor, keys like ``<module>.lora_A.weight`` (an adapter-name component
            before ``weight`` is accepted).
        source: file name for error messages.
        allow_alpha_keys: accept ``<module>.alpha`` scalar tensors (diffusers single-file exports).

    Returns:
        ``(pairs, alphas)``: module key -> ``(A [r, in], B [out, r])`` as float32 CPU tensors, and
        module key -> alpha for modules that carry one.

    Raises:
        LoRAFormatError: DoRA magnitude vectors, LoRA bias, modules_to_save copies, embedding LoRA,
            unknown keys (all named), a module with only one of A/B, several adapter names, bad shapes.
    """
    a_parts: dict[str, torch.Tensor] = {}
    b_parts: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    adapter_names: set[str] = set()
    unknown: list[str] = []
    for key, tensor in state_dict.items():
        if "lora_magnitude_vector" in key:
            raise LoRAFormatError(f"{source}: DoRA adapters are not supported (found {key!r})")
        if "modules_to_save" in key:
            raise LoRAFormatError(f"{source}: modules_to_save is not supported (found {key!r})")
        if ".lora_B." in key and key.endswith(".bias"):
            raise LoRAFormatError(f"{source}: LoRA bias (lora_bias=True) is not supported (found {key!r})")
        if "lora_embedding_" in key:
            raise LoRAFormatError(f"{source}: embedding LoRA is not supported (found {key!r})")
        match = _LORA_KEY.match(key)
        if match:
            if match.group("adapter"):
                adapter_names.add(match.group("adapter"))
            target = a_parts if match.group("which") == "A" else b_parts
            module = match.group("module")
            if module in target:
                raise LoRAFormatError(
                    f"{source}: module {module!r} appears twice (several adapters in one file?)"
                )
            target[module] = tensor.detach().to("cpu", torch.float32)
            continue
        alpha_match = _ALPHA_KEY.match(key) if allow_alpha_keys else None
        if alpha_match and tensor.numel() == 1:
            alphas[alpha_match.group("module")] = float(tensor.reshape(()).item())
            continue
        unknown.append(key)
    if unknown:
        shown = ", ".join(sorted(unknown)[:20])
        more = f" (+{len(unknown) - 20} more)" if len(unknown) > 20 else ""
        raise LoRAFormatError(f"{source}: keys that are not LoRA A/B weights: {shown}{more}")
    if len(adapter_names) > 1:
        raise LoRAFormatError(
            f"{source}: holds several adapters ({sorted(adapter_names)}); save them separately"
        )
    lonely = sorted(set(a_parts) ^ set(b_parts))
    if lonely:
        raise LoRAFormatError(f"{source}: modules with only one of lora_A / lora_B: {lonely}")
    if not a_parts:
        raise LoRAFormatError(f"{source}: holds no LoRA weights")
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, lora_a in a_parts.items():
        lora_b = b_parts[module]
        check_pair(module, lora_a, lora_b, source)
        pairs[module] = (lora_a, lora_b)
    stray_alphas = sorted(set(alphas) - set(pairs))
    if stray_alphas:
        raise LoRAFormatError(f"{source}: alpha values for modules without LoRA weights: {stray_alphas}")
    return pairs, alphas


def _strip_peft_prefix(key: str) -> str:
    prefix = "base_model.model."
    return key[len(prefix) :] if key.startswith(prefix) else key


def check_lora_config(config: object, source: str) -> None:
    """Reject PEFT configurations whose features this runtime does not implement.

    Raises:
        LoRAFormatError: non-LoRA PEFT type, or any field listed in ``_UNSUPPORTED_FIELDS`` set.
    """
    peft_type = getattr(config, "peft_type", None)
    peft_type_name = getattr(peft_type, "value", peft_type)
    if str(peft_type_name).upper() != "LORA":
        raise LoRAFormatError(f"{source}: PEFT type {peft_type_name!r} is not LoRA")
    for name, why in _UNSUPPORTED_FIELDS:
        value = getattr(config, name, None)
        if value:
            raise LoRAFormatError(f"{source}: {name}={value!r} is not supported: {why}")


def build_module_weights(
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    rank: int | None,
    lora_alpha: float | None,
    use_rslora: bool,
    rank_pattern: Mapping[str, int] | None,
    alpha_pattern: Mapping[str, float] | None,
    module_alphas: Mapping[str, float] | None,
    source: str,
) -> dict[str, LoRAModuleWeights]:
    """Attach a scaling to each ``(A, B)`` pair following peft's rules.

    The rank used for scaling is the tensor rank; when the configuration declares a rank for the
    module (``rank_pattern`` entry, else ``r``) it must agree. ``alpha`` comes from, in order: a
    per-module alpha tensor, ``alpha_pattern``, ``lora_alpha``, else the rank (``s = 1``).

    Raises:
        LoRAFormatError: declared and stored ranks differ (both named).
    """
    modules: dict[str, LoRAModuleWeights] = {}
    for key, (lora_a, lora_b) in pairs.items():
        pattern_key = _strip_peft_prefix(key)
        tensor_rank = int(lora_a.shape[0])
        declared = rank
        if rank_pattern:
            hit = match_pattern_key(rank_pattern, pattern_key)
            if hit is not None:
                declared = int(rank_pattern[hit])
        if declared is not None and declared != tensor_rank:
            raise LoRAFormatError(
                f"{source}: module {key!r} stores rank {tensor_rank} but the config declares rank {declared}"
            )
        if module_alphas and key in module_alphas:
            alpha = module_alphas[key]
        else:
            alpha = lora_alpha if lora_alpha is not None else tensor_rank
            if alpha_pattern:
                hit = match_pattern_key(alpha_pattern, pattern_key)
                if hit is not None:
                    alpha = alpha_pattern[hit]
        modules[key] = LoRAModuleWeights(lora_a, lora_b, lora_scaling(alpha, tensor_rank, use_rslora))
    return modules


def load_peft_adapter(path: str | os.PathLike[str]) -> LoRAAdapterWeights:
    """Read a PEFT LoRA directory into host memory.

    Args:
        path: directory holding ``adapter_config.json`` and ``adapter_model.safetensors``.

    Returns:
        :class:`LoRAAdapterWeights` with module keys as stored (``base_model.model.`` still
        present; prefixes are resolved when binding to a model), float32 CPU tensors, and each
        module's scaling ``s`` per peft's rules (rsLoRA, ``rank_pattern``, ``alpha_pattern``).

    Raises:
        FileNotFoundError: the directory or one of the two files is missing.
        LoRAFormatError: unsupported PEFT feature (DoRA, modules_to_save, ...), malformed tensors,
            or declared ranks that disagree with the stored tensors.
    """
    from peft import PeftConfig
    from safetensors.torch import load_file

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"LoRA adapter directory not found: {path!r}")
    config_file = os.path.join(path, ADAPTER_CONFIG_NAME)
    weights_file = os.path.join(path, ADAPTER_WEIGHTS_NAME)
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path!r} has no {ADAPTER_CONFIG_NAME}; not a PEFT adapter directory")
    if not os.path.isfile(weights_file):
        others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
        hint = f" (found {others}; convert them to safetensors)" if others else ""
        raise FileNotFoundError(f"{path!r} has no {ADAPTER_WEIGHTS_NAME}{hint}")
    config = PeftConfig.from_pretrained(path)
    check_lora_config(config, path)
    pairs, _ = split_lora_state_dict(load_file(weights_file, device="cpu"), weights_file)
    modules = build_module_weights(
        pairs,
        rank=getattr(config, "r", None),
        lora_alpha=getattr(config, "lora_alpha", None),
        use_rslora=bool(getattr(config, "use_rslora", False)),
        rank_pattern=getattr(config, "rank_pattern", None) or None,
        alpha_pattern=getattr(config, "alpha_pattern", None) or None,
        module_alphas=None,
        source=path,
    )
    return LoRAAdapterWeights(modules=modules, source=path)
