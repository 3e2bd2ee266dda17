"""PEFT-format adapters: a directory with ``adapter_config.json`` and ``adapter_model.safetensors``.

The configuration is read with peft's own ``PeftConfig.from_pretrained`` (so every field is
interpreted exactly as peft interprets it); tensors are read with safetensors (through
:mod:`.safetensors_format`, which also reads a lone ``adapter_model.safetensors`` next to its config).
The result is a format-neutral :class:`~.adapter.LoRAAdapterWeights`.

Rules (facts of peft's ``LoraConfig``, see its documentation):

* scaling ``s = lora_alpha / r``; with ``use_rslora`` ``s = lora_alpha / sqrt(r)``; ``lora_alpha`` must be
  present in the file (peft would fill in its default 8; we refuse instead);
* ``rank_pattern`` / ``alpha_pattern`` override ``r`` / ``lora_alpha`` for modules whose name ends
  with the pattern (a regular expression matched as ``(.*\\.)?(<pattern>)$``); the first matching
  pattern in the dict wins;
* ``target_modules`` (full-match regex string, list of names / suffixes, or ``"all-linear"``),
  ``exclude_modules`` and ``layers_to_transform`` are applied with peft's ``check_target_module_exists``;
  stored tensors for modules they do not select are refused (peft would ignore them);
* tensors are saved as ``base_model.model.<module>.lora_A.weight`` / ``...lora_B.weight``.

Unsupported features are rejected with :class:`~.adapter.LoRAFormatError` instead of being ignored:
DoRA (``use_dora`` or ``lora_magnitude_vector`` tensors), ``modules_to_save``, LoRA bias and ``bias`` other
than ``"none"``, trainable tokens, layer replication, parameter targeting, embedding / convolution LoRA,
quantised tensors, and non-LoRA PEFT types (see also :mod:`.formats.layouts`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Mapping

import torch

from vllm_omni.diffusion.lora.adapter import (
    LoRAAdapterWeights,
    LoRAFormatError,
    LoRAModuleWeights,
    candidate_module_keys,
    check_pair,
    lora_scaling,
)
from vllm_omni.diffusion.lora.formats.layouts import screen_state_dict

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
            before ``weight`` is accepted; kohya ``lora_down`` / ``lora_up`` must already be renamed,
            see :func:`.formats.layouts.normalize_lora_keys`).
        source: file name for error messages.
        allow_alpha_keys: accept ``<module>.alpha`` scalar tensors (kohya / ComfyUI / diffusers exports).

    Returns:
        ``(pairs, alphas)``: module key -> ``(A [r, in], B [out, r])`` as float32 CPU tensors, and
        module key -> alpha for modules that carry one.

    Raises:
        LoRAFormatError: anything :func:`.formats.layouts.screen_state_dict` refuses (DoRA, bias,
            modules_to_save, quantised tensors, ...), unknown keys (all named), a module with only
            one of A/B, several adapter names, bad shapes, NaN / inf weights.
    """
    screen_state_dict(state_dict, source)
    a_parts: dict[str, torch.Tensor] = {}
    b_parts: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    adapter_names: set[str] = set()
    unknown: list[str] = []
    for key, tensor in state_dict.items():
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
            alphas[alpha_match.group("module")] = float(tensor.reshape(()).float().item())
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
        if not (torch.isfinite(lora_a).all() and torch.isfinite(lora_b).all()):
            raise LoRAFormatError(f"{source}: module {module!r} holds NaN or inf weights")
        pairs[module] = (lora_a, lora_b)
    stray_alphas = sorted(set(alphas) - set(pairs))
    if stray_alphas:
        raise LoRAFormatError(f"{source}: alpha values for modules without LoRA weights: {stray_alphas}")
    return pairs, alphas


def check_lora_config(config: object, source: str) -> None:
    """Reject PEFT configurations whose features this runtime does not implement.

    Raises:
        LoRAFormatError: non-LoRA PEFT type, ``bias`` other than ``"none"``, or any field listed in
            ``_UNSUPPORTED_FIELDS`` set.
    """
    peft_type = getattr(config, "peft_type", None)
    peft_type_name = getattr(peft_type, "value", peft_type)
    if str(peft_type_name).upper() != "LORA":
        raise LoRAFormatError(f"{source}: PEFT type {peft_type_name!r} is not LoRA")
    for name, why in _UNSUPPORTED_FIELDS:
        value = getattr(config, name, None)
        if value:
            raise LoRAFormatError(f"{source}: {name}={value!r} is not supported: {why}")
    bias = getattr(config, "bias", "none") or "none"
    if bias != "none":
        raise LoRAFormatError(
            f"{source}: bias={bias!r} is not supported: trained bias vectors replace the base layer's bias, "
            "which request-time LoRA cannot swap; retrain with bias='none'"
        )


def lora_config_from_dict(raw: Mapping[str, object], source: str) -> object:
    """A peft ``LoraConfig`` from a configuration dict (``adapter_config.json`` content or diffusers
    header metadata), after checking the fields whose peft default would silently change the math.

    ``lora_alpha`` must be present: peft would fill in its default (8), and alpha-less exports
    elsewhere mean ``alpha = r``; neither can be assumed for a file that ships a configuration.

    Raises:
        LoRAFormatError: missing ``lora_alpha``, unsupported features (:func:`check_lora_config`).
    """
    from peft import LoraConfig

    if raw.get("peft_type", "LORA") not in ("LORA", None):
        raise LoRAFormatError(f"{source}: PEFT type {raw.get('peft_type')!r} is not LoRA")
    if raw.get("lora_alpha") is None:
        raise LoRAFormatError(
            f"{source}: the LoRA config has no lora_alpha, so the adapter scaling lora_alpha / r is unknown; "
            'add "lora_alpha" (the value used in training) to the config'
        )
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    kwargs = {k: v for k, v in raw.items() if k in known and k not in ("peft_type", "task_type")}
    try:
        config = LoraConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise LoRAFormatError(f"{source}: invalid LoRA config: {exc}") from exc
    check_lora_config(config, source)
    return config


def read_peft_config(directory: str, source: str | None = None) -> tuple[object, dict]:
    """Read ``<directory>/adapter_config.json`` with peft's ``PeftConfig`` (peft's own field rules).

    Returns:
        ``(config, raw_json)``.

    Raises:
        LoRAFormatError: unreadable JSON, missing ``lora_alpha``, unsupported features.
    """
    from peft import PeftConfig

    source = source or directory
    config_file = os.path.join(directory, ADAPTER_CONFIG_NAME)
    try:
        with open(config_file) as handle:
            raw = json.load(handle)
    except json.JSONDecodeError as exc:
        raise LoRAFormatError(f"{config_file}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise LoRAFormatError(f"{config_file}: not a JSON object")
    if raw.get("lora_alpha") is None and raw.get("peft_type", "LORA") == "LORA":
        raise LoRAFormatError(
            f"{config_file}: no lora_alpha, so the adapter scaling lora_alpha / r is unknown (peft would silently "
            'use its default 8); add "lora_alpha" (the value used in training) to the config'
        )
    config = PeftConfig.from_pretrained(directory)
    check_lora_config(config, source)
    return config, raw


def untargeted_modules(config: object, module_keys: Iterable[str]) -> list[str]:
    """Module keys that peft's ``target_modules`` / ``exclude_modules`` / ``layers_to_transform`` rules
    (peft's own ``check_target_module_exists``; a string is a full-match regex, a list matches names
    or dotted suffixes) would not give a LoRA layer; peft would ignore their tensors.

    ``"all-linear"`` targets every linear layer, which binding checks, so only exclusions apply.
    Keys are tried with and without their wrapper prefixes (``base_model.model.`` ...).
    """
    from peft.tuners.tuners_utils import check_target_module_exists

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
    per-module alpha tensor (kohya ``.alpha``), ``alpha_pattern``, ``lora_alpha``, else the rank
    (``s = 1``, the convention of alpha-less exports). Patterns are matched against the module key
    without wrapper prefixes (what peft sees inside the base model).

    Raises:
        LoRAFormatError: declared and stored ranks differ (both named); an alpha of 0 or not finite.
    """
    modules: dict[str, LoRAModuleWeights] = {}
    for key, (lora_a, lora_b) in pairs.items():
        pattern_key = candidate_module_keys(key)[-1]
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
        if not math.isfinite(float(alpha)) or float(alpha) == 0.0:
            raise LoRAFormatError(
                f"{source}: module {key!r} has alpha {alpha!r}, which makes its scaling alpha / r "
                f"{'zero (the adapter would change nothing)' if float(alpha) == 0.0 else 'not finite'}"
            )
        modules[key] = LoRAModuleWeights(lora_a, lora_b, lora_scaling(alpha, tensor_rank, use_rslora))
    return modules


def load_peft_adapter(path: str | os.PathLike[str]) -> LoRAAdapterWeights:
    """Read a PEFT LoRA directory (peft's ``save_pretrained`` layout) into host memory.

    Args:
        path: directory holding ``adapter_config.json`` and ``adapter_model.safetensors``.

    Returns:
        :class:`LoRAAdapterWeights` with module keys as stored (``base_model.model.`` still
        present; prefixes are resolved when binding to a model), float32 CPU tensors, and each
        module's scaling ``s`` per peft's rules (rsLoRA, ``rank_pattern``, ``alpha_pattern``).

    Raises:
        FileNotFoundError: the directory or one of the two files is missing.
        LoRAFormatError: unsupported PEFT feature (DoRA, modules_to_save, bias, ...), a config without
            ``lora_alpha``, malformed or quantised tensors, or declared ranks that disagree with the
            stored tensors.
    """
    from vllm_omni.diffusion.lora.safetensors_format import load_lora_safetensors

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
    return load_lora_safetensors(weights_file)
