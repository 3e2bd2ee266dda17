"""Single-file LoRA checkpoints with diffusers / PEFT-style keys (``<module>.lora_A.weight``).

Used by the distill backend (:mod:`.fuse`) and accepted by the manager for ``.safetensors`` paths.
The adapter scaling of each module comes from, in order:

1. a ``<module>.alpha`` scalar tensor in the file (``s = alpha / r``);
2. the ``lora_adapter_metadata`` JSON that diffusers writes into the safetensors header (the LoRA
   config: ``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``, ``alpha_pattern``; keys may carry a
   component prefix such as ``transformer.``);
3. otherwise ``s = 1`` (alpha taken equal to the rank, the convention of alpha-less exports).

Other key layouts (kohya ``lora_down`` / ``lora_up``, ComfyUI names) belong in their own module that
produces a :class:`~.adapter.LoRAAdapterWeights` the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

from vllm_omni.diffusion.lora.adapter import LoRAAdapterWeights, LoRAFormatError
from vllm_omni.diffusion.lora.peft_format import (
    build_module_weights,
    check_lora_config,
    split_lora_state_dict,
)

METADATA_KEY = "lora_adapter_metadata"
_COMPONENT_PREFIXES = ("transformer.", "transformer_2.", "unet.")


def _config_from_metadata(metadata: Mapping[str, str] | None, source: str) -> dict | None:
    if not metadata or METADATA_KEY not in metadata:
        return None
    try:
        raw = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise LoRAFormatError(f"{source}: {METADATA_KEY} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise LoRAFormatError(f"{source}: {METADATA_KEY} is not a JSON object")
    config: dict = {}
    for key, value in raw.items():
        for prefix in _COMPONENT_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        config[key] = value
    return config


class _ConfigView:
    """Attribute view over a metadata dict, for :func:`check_lora_config`."""

    def __init__(self, config: Mapping) -> None:
        self.__dict__.update(config)
        self.peft_type = config.get("peft_type", "LORA")


def adapter_from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
    source: str = "<state dict>",
) -> LoRAAdapterWeights:
    """Parse a single-file LoRA state dict.

    Args:
        state_dict: key -> tensor with ``lora_A`` / ``lora_B`` keys and optional ``.alpha`` scalars.
        metadata: the safetensors header metadata, if any.
        source: name for error messages.

    Raises:
        LoRAFormatError: unknown keys, DoRA / bias / modules_to_save, unpaired or malformed tensors,
            or a metadata config that declares unsupported features or ranks that disagree.
    """
    config = _config_from_metadata(metadata, source)
    pairs, alphas = split_lora_state_dict(state_dict, source, allow_alpha_keys=True)
    if config is not None:
        check_lora_config(_ConfigView(config), source)
    config = config or {}
    modules = build_module_weights(
        pairs,
        rank=config.get("r"),
        lora_alpha=config.get("lora_alpha"),
        use_rslora=bool(config.get("use_rslora", False)),
        rank_pattern=config.get("rank_pattern") or None,
        alpha_pattern=config.get("alpha_pattern") or None,
        module_alphas=alphas,
        source=source,
    )
    return LoRAAdapterWeights(modules=modules, source=source)


def load_lora_safetensors(path: str | os.PathLike[str]) -> LoRAAdapterWeights:
    """Read a single ``.safetensors`` LoRA file (see module docstring for the scaling rules).

    Raises:
        FileNotFoundError: missing file.
        LoRAFormatError: see :func:`adapter_from_state_dict`.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"LoRA file not found: {path!r}")
    with safe_open(path, framework="pt", device="cpu") as handle:
        metadata = handle.metadata()
        state_dict = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    return adapter_from_state_dict(state_dict, metadata=metadata, source=path)
