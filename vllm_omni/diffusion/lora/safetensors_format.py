"""The diffusion adapter readers: a PEFT directory, or a single ``.safetensors`` file in any key layout.

Files are located, read and checked by :mod:`vllm_omni.lora.adapter_files` (shared with the LLM gate and
the HTTP registry); this module adds the diffusion key layouts of :mod:`.formats.layouts` and the
scaling rules of :mod:`.peft_format`, producing a :class:`~.adapter.LoRAAdapterWeights`.

LoHa / LoKr modules (``hada_*`` / ``lokr_*`` keys, peft ``LoHaConfig`` / ``LoKrConfig`` directories)
are read by :mod:`.formats.lycoris` into their exact LoRA-equivalent factors.

Key layouts: PEFT (``base_model.model.``), diffusers (``transformer.``), ComfyUI (``diffusion_model.``),
kohya / A1111 (``lora_unet_`` + underscore-flattened module paths; LyCORIS' ``lycoris_`` read as ``lora_unet_``). ``lora_down`` / ``lora_up`` are read as
``lora_A`` / ``lora_B``. Module names are resolved against the model when the adapter is bound
(:mod:`.formats.model_keys`: diffusers' converter for the model family, else generic un-flattening).

The adapter scaling of each module comes from, in order:

1. a PEFT configuration: a sibling ``adapter_config.json`` (peft's ``save_pretrained`` layout, read with
   ``PeftConfig``) or the ``lora_adapter_metadata`` JSON that diffusers' ``save_lora_weights`` writes into
   the safetensors header (keys may carry a component prefix such as ``transformer.``); when both exist
   they must agree. ``lora_alpha`` must be present;
2. a ``<module>.alpha`` scalar tensor (kohya / ComfyUI: ``s = alpha / r`` per module); alongside a
   configuration it must agree with it;
3. otherwise ``s = 1`` (alpha equal to the rank, kohya's and diffusers' convention for alpha-less files).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import replace

import torch

from vllm_omni.diffusion.lora.adapter import LoRAAdapterWeights
from vllm_omni.diffusion.lora.formats.layouts import (
    canonical_flat_prefix,
    detect_layout,
    key_refusal,
    normalize_lora_keys,
    screen_state_dict,
    split_deltas,
)
from vllm_omni.diffusion.lora.formats.lycoris import (
    lycoris_module_weights,
    read_lycoris_config,
    split_lycoris,
)
from vllm_omni.diffusion.lora.formats.text_encoders import split_text_encoder_parts
from vllm_omni.diffusion.lora.peft_format import build_module_weights, untargeted_modules
from vllm_omni.errors import LoRAFormatError
from vllm_omni.lora.adapter_files import (
    ADAPTER_CONFIG_NAME,
    listing,
    locate_adapter,
    lora_config_from_dict,
    pair_lora_tensors,
    read_adapter_config,
    read_safetensors,
)

METADATA_KEY = "lora_adapter_metadata"
_COMPONENT_PREFIXES = ("transformer.", "transformer_2.", "unet.")
_SCALING_FIELDS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern")


def _config_from_metadata(
    metadata: Mapping[str, str] | None, source: str, component: str | None = None
) -> dict | None:
    """The LoRA configuration in the ``lora_adapter_metadata`` header: the denoiser's (keys bare or under
    ``transformer.`` / ``unet.``), or with ``component`` that text encoder's (keys under ``<component>.``,
    as diffusers' ``save_lora_weights`` packs them); ``None`` when absent."""
    if not metadata or METADATA_KEY not in metadata:
        return None
    try:
        raw = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise LoRAFormatError(f"{source}: {METADATA_KEY} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise LoRAFormatError(f"{source}: {METADATA_KEY} is not a JSON object")
    if component is not None:
        mine = {k[len(component) + 1 :]: v for k, v in raw.items() if k.startswith(component + ".")}
        return mine or None
    prefixed = any("." in key for key in raw)
    config: dict = {}
    for key, value in raw.items():
        for prefix in _COMPONENT_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        else:
            if prefixed and "." in key:
                continue  # another component's config (e.g. text_encoder.r)
        config[key] = value
    return config


def _check_configs_agree(first: object, second: object, source: str, what: str) -> None:
    diffs = [
        f"{name}: {getattr(first, name, None)!r} vs {getattr(second, name, None)!r}"
        for name in _SCALING_FIELDS
        if (getattr(first, name, None) or None) != (getattr(second, name, None) or None)
    ]
    if diffs:
        raise LoRAFormatError(f"{source}: {what} disagree ({'; '.join(diffs)}); remove the stale one")


def adapter_from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
    source: str = "<state dict>",
    config: object | None = None,
    lora_biases: bool = False,
) -> LoRAAdapterWeights:
    """Parse a single-file LoRA state dict in any supported key layout.

    Args:
        state_dict: key -> tensor with ``lora_A`` / ``lora_B`` (or ``lora_down`` / ``lora_up``) keys and
            optional ``.alpha`` scalars.
        metadata: the safetensors header metadata, if any.
        source: name for error messages.
        config: a peft ``LoraConfig`` that belongs to these tensors (sibling ``adapter_config.json``).
        lora_biases: read ``<module>.lora_B.bias`` tensors (``[d_out]``) as the module's ``lora_bias``
            (what diffusers' Wan converter makes of lightx2v ``diff_b`` keys); refused otherwise.

    A configuration-less ComfyUI-layout file's ``.diff`` / ``.diff_b`` tensors are set aside
    (:attr:`~.adapter.LoRAAdapterWeights.deltas`, kept in ``raw_state_dict``) for the model family's
    converter at bind time (:mod:`.formats.model_keys`).

    Raises:
        LoRAFormatError: refused tensors (DoRA, bias, modules_to_save, quantised, ...), unknown keys,
            unpaired or malformed tensors, a config without ``lora_alpha``, configs or ``.alpha`` values
            that disagree, or declared ranks that disagree with the tensors.
    """
    denoiser_part, text_parts = split_text_encoder_parts(state_dict)
    if text_parts:
        return _with_text_encoder_parts(
            denoiser_part, text_parts, metadata=metadata, source=source, config=config
        )
    state_dict = canonical_flat_prefix(state_dict, source)
    raw = state_dict
    state_dict, deltas = split_deltas(state_dict) if config is None else (state_dict, {})
    state_dict, biases = _split_biases(state_dict) if lora_biases else (state_dict, {})
    screen_state_dict(state_dict, source)
    lycoris, rest = split_lycoris(state_dict)
    meta_raw = _config_from_metadata(metadata, source)
    if deltas and (lycoris or meta_raw is not None):  # only a configuration-less LoRA file is converted
        raise key_refusal(deltas, source)
    if lycoris or type(config).__name__ in ("LoHaConfig", "LoKrConfig"):
        return _lycoris_adapter(state_dict, lycoris, rest, metadata=metadata, source=source, config=config)
    if meta_raw is not None:
        meta_config = lora_config_from_dict(meta_raw, source)
        if config is None:
            config = meta_config
        else:
            _check_configs_agree(
                config, meta_config, source, f"{ADAPTER_CONFIG_NAME} and the {METADATA_KEY} header"
            )
    layout = detect_layout(state_dict)
    pairs, alphas = pair_lora_tensors(normalize_lora_keys(state_dict, source), source, allow_alpha_keys=True)
    modules = _attach_biases(
        build_module_weights(pairs, config=config, module_alphas=alphas, source=source), biases, source
    )
    if config is not None and alphas:
        from_config = build_module_weights(pairs, config=config, module_alphas=None, source=source)
        stale = sorted(k for k in alphas if not math.isclose(modules[k].scaling, from_config[k].scaling))
        if stale:
            raise LoRAFormatError(
                f"{source}: .alpha tensors disagree with the LoRA config's lora_alpha / alpha_pattern for "
                f"{stale[:12]}; remove the stale one"
            )
    return LoRAAdapterWeights(
        modules=modules,
        source=source,
        layout=layout,
        raw_state_dict=dict(raw) if config is None else None,
        has_config=config is not None,
        base_model_name_or_path=getattr(config, "base_model_name_or_path", None)
        if config is not None
        else None,
        untargeted=untargeted_modules(config, modules) if config is not None else [],
        deltas=sorted(deltas),
    )


_BIAS_SUFFIX = ".lora_B.bias"


def _split_biases(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    rest = {k: v for k, v in state_dict.items() if not k.endswith(_BIAS_SUFFIX)}
    return rest, {k[: -len(_BIAS_SUFFIX)]: v for k, v in state_dict.items() if k.endswith(_BIAS_SUFFIX)}


def _attach_biases(modules: dict, biases: Mapping[str, torch.Tensor], source: str) -> dict:
    """``modules`` with each ``biases[module]`` (``[d_out]``, finite) as its ``lora_bias``, float32.

    Raises:
        LoRAFormatError: a bias for a module without LoRA weights, of another length than ``B``'s rows,
            or not finite (the key is named).
    """
    for module, bias in biases.items():
        key = module + _BIAS_SUFFIX
        weights = modules.get(module)
        if weights is None:
            raise LoRAFormatError(f"{source}: {key!r} is a LoRA bias for a module without lora_A / lora_B")
        if bias.dim() != 1 or bias.shape[0] != weights.out_features or not bias.is_floating_point():
            raise LoRAFormatError(
                f"{source}: {key!r} has shape {tuple(bias.shape)} ({bias.dtype}); expected "
                f"({weights.out_features},), the rows of its lora_B"
            )
        bias = bias.detach().to("cpu", torch.float32)
        if not torch.isfinite(bias).all():
            raise LoRAFormatError(f"{source}: {key!r} holds NaN or inf")
        modules[module] = replace(weights, lora_bias=bias)
    return modules


def _with_text_encoder_parts(
    denoiser_part, text_parts, *, metadata, source: str, config
) -> LoRAAdapterWeights:
    """A file with text-encoder parts (:mod:`.formats.text_encoders`): the denoiser part parsed as the
    file (the sibling configuration applies to it), each text-encoder part with the configuration
    diffusers stores for that component in the header, else its ``.alpha`` tensors (kohya), else
    ``alpha = r``."""
    encoders = {}
    for component, part in text_parts.items():
        where = f"{source} [{component}]"
        raw = _config_from_metadata(metadata, source, component)
        part_config = lora_config_from_dict(raw, where) if raw is not None else None
        encoders[component] = adapter_from_state_dict(part, source=where, config=part_config)
    if denoiser_part:
        adapter = adapter_from_state_dict(denoiser_part, metadata=metadata, source=source, config=config)
    else:
        first = next(iter(encoders.values()))
        adapter = LoRAAdapterWeights(source=source, layout=first.layout, has_config=config is not None)
    adapter.text_encoders = encoders
    return adapter


def _lycoris_adapter(state_dict, lycoris, rest, *, metadata, source: str, config) -> LoRAAdapterWeights:
    """A file or directory with LoHa / LoKr modules (and, in a configuration-less file, plain LoRA ones).

    Raises:
        LoRAFormatError: a LoHa / LoKr configuration without such tensors or with plain LoRA tensors
            beside them; see :func:`.formats.lycoris.lycoris_module_weights`.
    """
    if config is not None and (rest or not lycoris):
        what = "plain LoRA keys" if rest else "no hada_* / lokr_* tensors"
        raise LoRAFormatError(f"{source}: {type(config).__name__} with {what}: {listing(sorted(rest))}")
    modules = lycoris_module_weights(lycoris, config=config, source=source)
    if rest:
        modules.update(adapter_from_state_dict(rest, metadata=metadata, source=source).modules)
    return LoRAAdapterWeights(
        modules=modules,
        source=source,
        layout=detect_layout(state_dict),
        has_config=config is not None,
        base_model_name_or_path=getattr(config, "base_model_name_or_path", None),
        untargeted=untargeted_modules(config, modules) if config is not None else [],
    )


def load_lora_safetensors(path: str | os.PathLike[str]) -> LoRAAdapterWeights:
    """Read a single ``.safetensors`` LoRA file (see the module docstring for layouts and scaling).

    A sibling ``adapter_config.json`` in the same directory is taken as the file's PEFT configuration
    (peft's ``save_pretrained`` writes them side by side).

    Raises:
        FileNotFoundError: missing file.
        LoRAFormatError: see :func:`adapter_from_state_dict` and :mod:`vllm_omni.lora.adapter_files`.
    """
    files = locate_adapter(path)
    return _read(files, os.fspath(path))


def load_peft_adapter(path: str | os.PathLike[str]) -> LoRAAdapterWeights:
    """Read a PEFT LoRA directory (peft's ``save_pretrained`` layout) into host memory.

    Args:
        path: directory holding ``adapter_config.json`` and ``adapter_model.safetensors``.

    Returns:
        :class:`LoRAAdapterWeights` with module keys as stored (``base_model.model.`` still
        present; prefixes are resolved when binding to a model), float32 CPU tensors, and each
        module's scaling ``s`` per peft's rules (rsLoRA, ``rank_pattern``, ``alpha_pattern``).

    Raises:
        FileNotFoundError: the directory is missing.
        LoRAFormatError: a missing or pickle-only file, an unsupported PEFT feature (DoRA,
            modules_to_save, bias, ...), a config without ``lora_alpha``, malformed or quantised
            tensors, or declared ranks that disagree with the stored tensors.
    """
    files = locate_adapter(path)
    return _read(files, files.weights)


def _read(files, source: str) -> LoRAAdapterWeights:
    config = None
    if files.config is not None:
        config = (
            read_lycoris_config(files.config, source) or read_adapter_config(files.config, source=source)[0]
        )
    state_dict, metadata = read_safetensors(files.weights, source)
    return adapter_from_state_dict(state_dict, metadata=metadata, source=source, config=config)
