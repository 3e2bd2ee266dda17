"""Rewrite one PEFT LoRA adapter into the single-file layouts other trainers produce (test data).

The input is what peft's ``save_pretrained`` writes (``adapter_config.json`` + ``adapter_model.safetensors``
with ``base_model.model.<module>.lora_A.weight`` keys). Every writer below only renames keys and moves the
adapter scaling ``s`` into the form the target layout carries, so a correct loader must reproduce the
PEFT original exactly:

* :func:`write_diffusers`: ``transformer.<module>.lora_A.weight`` + the LoRA config as JSON under
  ``lora_adapter_metadata`` in the safetensors header (diffusers' ``save_lora_weights`` layout);
* :func:`write_comfyui`: ``diffusion_model.<module>`` names with ``lora_A``/``lora_B`` or
  ``lora_down``/``lora_up`` and a per-module ``.alpha`` (ComfyUI / musubi-tuner style), optionally with
  the original Z-Image name ``attention.out`` for ``attention.to_out.0``;
* :func:`write_kohya`: kohya-ss / A1111 ``lora_unet_<module with . -> _>.lora_down.weight`` /
  ``.lora_up.weight`` / ``.alpha`` (or LyCORIS' ``lycoris_`` prefix);
* :func:`write_alpha_file`: any prefix with ``lora_A``/``lora_B`` and ``.alpha`` keys, no configuration;
* :func:`write_lycoris`: a peft LoHa / LoKr directory as a LyCORIS / kohya file (``hada_*`` / ``lokr_*``).

Per-module ``.alpha`` is ``s * r`` (kohya's rule ``s = alpha / r``), which also carries peft's
``alpha_pattern`` and rsLoRA (``lora_alpha / sqrt(r)``) exactly.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


def _pattern_value(patterns: dict, module: str, default):
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def read_peft(directory: str) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict]:
    """``({module: (A, B)}, adapter_config)`` of a PEFT directory."""
    with open(os.path.join(directory, "adapter_config.json")) as handle:
        config = json.load(handle)
    tensors = load_file(os.path.join(directory, "adapter_model.safetensors"))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"unexpected PEFT key {key!r}")
        parts.setdefault(match.group("module"), {})[match.group("which")] = value
    return {m: (p["A"], p["B"]) for m, p in parts.items()}, config


def module_alpha(config: dict, module: str, rank: int) -> float:
    """The ``alpha`` that gives peft's scaling for ``module`` under kohya's rule ``s = alpha / r``."""
    alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return scaling * rank


def _save(tensors: dict[str, torch.Tensor], path: str, metadata: dict | None = None) -> str:
    header = {"format": "pt"}
    if metadata is not None:
        header["lora_adapter_metadata"] = json.dumps(metadata)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=header)
    return path


def write_diffusers(directory: str, path: str, *, dtype: torch.dtype | None = None) -> str:
    """diffusers ``save_lora_weights`` layout: ``transformer.`` keys, config in the header metadata."""
    pairs, config = read_peft(directory)
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"transformer.{module}.lora_A.weight"] = a if dtype is None else a.to(dtype)
        tensors[f"transformer.{module}.lora_B.weight"] = b if dtype is None else b.to(dtype)
    fields = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules", "use_dora")
    metadata = {f"transformer.{k}": config.get(k) for k in fields if k in config}
    return _save(tensors, path, metadata)


def write_alpha_file(directory: str, path: str, *, prefix: str = PEFT_PREFIX) -> str:
    """``<prefix><module>.lora_A/B.weight`` plus a per-module ``.alpha``; no configuration anywhere."""
    pairs, config = read_peft(directory)
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"{prefix}{module}.lora_A.weight"] = a
        tensors[f"{prefix}{module}.lora_B.weight"] = b
        tensors[f"{prefix}{module}.alpha"] = torch.tensor(module_alpha(config, module, a.shape[0]))
    return _save(tensors, path)


def write_comfyui(
    directory: str,
    path: str,
    *,
    down_up: bool = False,
    rename: Callable[[str], str] | None = None,
) -> str:
    """``diffusion_model.<module>`` keys (``lora_down``/``lora_up`` when ``down_up``) and ``.alpha``;
    ``rename`` maps diffusers module names to the original model's (e.g. :func:`z_image_original_name`)."""
    pairs, config = read_peft(directory)
    tensors = {}
    down, up = ("lora_down", "lora_up") if down_up else ("lora_A", "lora_B")
    for module, (a, b) in pairs.items():
        name = rename(module) if rename else module
        tensors[f"diffusion_model.{name}.{down}.weight"] = a
        tensors[f"diffusion_model.{name}.{up}.weight"] = b
        tensors[f"diffusion_model.{name}.alpha"] = torch.tensor(module_alpha(config, module, a.shape[0]))
    return _save(tensors, path)


def z_image_original_name(module: str) -> str:
    """Z-Image's original (non-diffusers) name for an attention output projection: ``attention.out``."""
    return re.sub(r"\.attention\.to_out\.0$", ".attention.out", module)


def write_kohya(directory: str, path: str, *, with_alpha: bool = True, prefix: str = "lora_unet_") -> str:
    """kohya-ss / A1111: ``lora_unet_<module, dots as underscores>.lora_down/lora_up.weight`` + ``.alpha``.

    Without ``.alpha`` kohya's convention is ``alpha = r`` (``s = 1``), so the scaling is folded into
    ``lora_up`` instead. ``prefix="lycoris_"`` gives LyCORIS' own naming of a wrapped generic module
    (its ``algo="lora"`` network: the same flattened paths and ``lora_down`` / ``lora_up`` / ``.alpha``).
    """
    pairs, config = read_peft(directory)
    tensors = {}
    for module, (a, b) in pairs.items():
        flat = prefix + module.replace(".", "_")
        alpha = module_alpha(config, module, a.shape[0])
        tensors[f"{flat}.lora_down.weight"] = a
        if with_alpha:
            tensors[f"{flat}.lora_up.weight"] = b
            tensors[f"{flat}.alpha"] = torch.tensor(alpha)
        else:
            tensors[f"{flat}.lora_up.weight"] = b * (alpha / a.shape[0])
    return _save(tensors, path)


def edit_peft(
    directory: str,
    out_dir: str,
    *,
    config_update: dict | None = None,
    config_remove: tuple[str, ...] = (),
    tensors_update: dict[str, torch.Tensor] | None = None,
    transform: Callable[[str, torch.Tensor], tuple[str, torch.Tensor] | None] | None = None,
) -> str:
    """Copy a PEFT directory with its config and tensors edited (for refusal tests)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json")) as handle:
        config = json.load(handle)
    config.update(config_update or {})
    for key in config_remove:
        config.pop(key, None)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as handle:
        json.dump(config, handle)
    tensors = load_file(os.path.join(directory, "adapter_model.safetensors"))
    if transform is not None:
        tensors = dict(filter(None, (transform(k, v) for k, v in tensors.items())))
    tensors.update(tensors_update or {})
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "adapter_model.safetensors")
    )
    return out_dir


def write_lycoris(directory: str, path: str, *, prefix: str = "lora_unet_", with_alpha: bool = True) -> str:
    """A peft LoHa / LoKr directory as a LyCORIS / kohya single file.

    Keys: ``<prefix><module, dots as underscores>.hada_w1_a`` ... / ``.lokr_w1`` ... (LyCORIS' names,
    no ``.weight``) and a per-module ``.alpha`` such that LyCORIS' ``alpha / dim`` equals peft's
    ``alpha / r`` (``dim``: the inner size of ``hada_w1_b``; for LoKr of ``lokr_w2_b``, else
    ``lokr_w1_b``). Where LyCORIS has no ``dim`` (both LoKr factors whole) or ``with_alpha`` is false,
    ``s = 1`` in the file, so the scaling is folded into ``hada_w1_a`` / ``lokr_w1`` (or ``lokr_w1_a``).
    """
    with open(os.path.join(directory, "adapter_config.json")) as handle:
        config = json.load(handle)
    tensors = load_file(os.path.join(directory, "adapter_model.safetensors"))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, name = key.removeprefix(PEFT_PREFIX).rpartition(".")
        modules.setdefault(module, {})[name] = value
    out = {}
    for module, parts in modules.items():
        rank = int(_pattern_value(config.get("rank_pattern"), module, config["r"]))
        scaling = _pattern_value(config.get("alpha_pattern"), module, config["alpha"]) / rank
        if "hada_w1_b" in parts:
            dim = parts["hada_w1_b"].shape[0]
        else:
            dim = next((parts[k].shape[0] for k in ("lokr_w2_b", "lokr_w1_b") if k in parts), None)
        flat = prefix + module.replace(".", "_")
        if with_alpha and dim is not None:
            out[f"{flat}.alpha"] = torch.tensor(float(scaling * dim))
        else:
            fold = next(k for k in ("hada_w1_a", "lokr_w1", "lokr_w1_a") if k in parts)
            parts = {**parts, fold: parts[fold] * scaling}
        out.update({f"{flat}.{name}": t for name, t in parts.items()})
    return _save(out, path)
