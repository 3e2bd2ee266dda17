"""Distill backend: fuse LoRA weights into the base weights once, at start-up.

    W <- W + lambda * s * B A          (peft's ``merge``: ``W + scaling * B @ A``)
    bias <- bias + lambda * s * b      (a bias delta, lightx2v ``diff_b``: peft's ``lora_B.bias`` merge)

computed in float32 and written back in the weight's dtype, into the matching rows of packed layers
(``to_q`` -> the q rows of ``to_qkv``) and only this rank's shard under tensor parallelism.

Must run after the checkpoint is loaded and *before* ``quant_method.process_weights_after_loading``
(on CPU that call repacks the weight for the GEMM kernel and leaves ``layer.weight`` empty); a layer
whose weight no longer has its plain ``[out_local, in_local]`` shape is refused. Quantised layers are
refused too. Every layer is checked before the first one is modified, so an error changes nothing.
"""

from __future__ import annotations

import math
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
import torch.nn as nn

from vllm_omni.diffusion.lora.adapter import LoRAAdapterWeights
from vllm_omni.diffusion.lora.formats.text_encoders import fit_part_to_encoder, text_encoder_parts_refusal
from vllm_omni.diffusion.lora.loading import load_lora_adapter
from vllm_omni.diffusion.lora.safetensors_format import adapter_from_state_dict
from vllm_omni.diffusion.lora.targets import (
    DEFAULT_DENOISER_ATTRS,
    StackedParamsMapping,
    TargetIndex,
    bind_adapter,
    find_denoisers,
    mapping_from_models,
)
from vllm_omni.diffusion.lora.text_encoder_lora import find_text_encoders
from vllm_omni.errors import ConfigError, LoRAFormatError, OmniUserError, restate

AdapterSource = str | os.PathLike[str] | Mapping[str, torch.Tensor] | LoRAAdapterWeights


def _as_adapter(source: AdapterSource, metadata: Mapping[str, str] | None) -> LoRAAdapterWeights:
    if isinstance(source, LoRAAdapterWeights):
        return source
    if isinstance(source, (str, os.PathLike)):
        return load_lora_adapter(source)
    if isinstance(source, Mapping):
        return adapter_from_state_dict(source, metadata=metadata)
    raise TypeError(f"cannot read a LoRA adapter from {type(source).__name__}")


def _plain_weight(module: nn.Module, name: str, shape: tuple[int, int]) -> torch.Tensor:
    quant = getattr(module, "quant_method", None)
    if quant is not None and type(quant).__name__ != "UnquantizedLinearMethod":
        raise RuntimeError(f"cannot fuse LoRA into {name!r}: quantised layer ({type(quant).__name__})")
    weight = getattr(module, "weight", None)
    if weight is None or tuple(weight.shape) != shape:
        got = None if weight is None else tuple(weight.shape)
        raise RuntimeError(
            f"cannot fuse LoRA into {name!r}: weight has shape {got}, expected {shape}; fuse after loading the "
            "checkpoint and before quant_method.process_weights_after_loading (which repacks the weight)"
        )
    return weight


def _plain_bias(module: nn.Module, name: str, rows: int) -> torch.Tensor:
    bias = getattr(module, "bias", None)
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (rows,):
        got = None if not isinstance(bias, torch.Tensor) else tuple(bias.shape)
        raise LoRAFormatError(
            f"cannot fuse a LoRA bias delta into {name!r}: its bias has shape {got}, expected ({rows},) "
            "(a layer built with bias=False has none to add to)"
        )
    return bias


def fuse_lora_into_model(
    model: object,
    adapter: AdapterSource,
    scale: float = 1.0,
    *,
    stacked_params_mapping: StackedParamsMapping | None = None,
    metadata: Mapping[str, str] | None = None,
    denoiser_attrs: Sequence[str] = DEFAULT_DENOISER_ATTRS,
) -> list[str]:
    """Add ``scale * s * B @ A`` of every adapter module into the model's weights, and ``scale * s * b``
    of a module's bias delta (lightx2v ``diff_b``, :attr:`~.adapter.LoRAModuleWeights.lora_bias`) into
    the layer's bias, as peft's ``merge`` does for ``lora_B.bias``.

    Args:
        model: a denoiser module or a pipeline (see :func:`.targets.find_denoisers`).
        adapter: a ``.safetensors`` file, a PEFT directory, a state dict (diffusers / PEFT keys,
            optional ``.alpha`` tensors, ``metadata`` as in the file header) or parsed weights.
        scale: the user's ``lambda``.
        stacked_params_mapping: packed-layer mapping (defaults to the model's own attribute).

    Returns:
        Qualified names of the layers that were modified.

    Raises:
        ConfigError: non-finite ``scale``.
        LoRAFormatError: unreadable adapter, unmatched module names, shape mismatch, a bias delta for a
            layer without a bias.
        RuntimeError: a target weight was already processed / repacked, or is quantised.
    """
    if isinstance(scale, bool) or not math.isfinite(float(scale)):
        raise ConfigError(f"LoRA fuse scale must be finite, got {scale!r}")
    denoisers = find_denoisers(model, denoiser_attrs)
    mapping = mapping_from_models(denoisers) if stacked_params_mapping is None else stacked_params_mapping
    index = TargetIndex(denoisers, mapping)
    adapter = _as_adapter(adapter, metadata)
    if adapter.text_encoders:  # never dropped silently
        why = "this call fuses into denoisers; fuse_lora_files_into_pipeline fuses text-encoder parts too"
        raise LoRAFormatError(text_encoder_parts_refusal(adapter, why))
    bound = bind_adapter(adapter, index)

    plan: list[tuple[str, torch.Tensor, list[tuple[slice, torch.Tensor]]]] = []
    for name, weights in bound.items():
        target = index.targets[name]
        g = target.geometry
        weight = _plain_weight(target.module, name, (g.out_local, g.in_local))
        updates: list[tuple[slice, torch.Tensor]] = []
        bias_updates: list[tuple[slice, torch.Tensor]] = []
        biases = weights.biases or (None,) * len(g.slices)
        for sl, pair, bias in zip(g.slices, weights.slices, biases, strict=True):
            if pair is None:
                continue
            lora_a, scaled_b = pair
            start, length = sl.rows_within_slice()
            rows = slice(sl.local_offset, sl.local_offset + length)
            a_local = lora_a[:, g.in_start : g.in_start + g.in_local].double()
            updates.append((rows, (scaled_b[start : start + length].double() @ a_local) * float(scale)))
            if bias is not None:
                bias_updates.append((rows, bias[start : start + length].double() * float(scale)))
        plan.append((name, weight, updates))
        if bias_updates:
            plan.append((name, _plain_bias(target.module, name, g.out_local), bias_updates))

    with torch.no_grad():
        for _, param, updates in plan:
            for rows, delta in updates:
                part = param.data[rows]
                param.data[rows] = (part.double() + delta.to(part.device)).to(param.dtype)
    return list(dict.fromkeys(name for name, _, _ in plan))


def fuse_lora_files_into_pipeline(
    pipeline: object,
    adapters: Sequence[AdapterSource],
    scales: Sequence[float] | None = None,
    *,
    denoiser_attrs: Sequence[str] = DEFAULT_DENOISER_ATTRS,
) -> dict[str, list[str]]:
    """Fuse the i-th adapter into the i-th denoiser (e.g. Wan2.2: high-noise file -> ``transformer``,
    low-noise file -> ``transformer_2``), and its text-encoder parts (:mod:`.formats.text_encoders`) into
    the pipeline's text encoders (:func:`.text_encoder_lora.find_text_encoders`), at the same scale, as
    diffusers' ``fuse_lora(components=[...])`` does.

    Returns:
        denoiser or text-encoder attribute -> fused layer names.

    Raises:
        ConfigError: more adapters than denoisers, or ``scales`` of another length.
        LoRAFormatError: a file that binds no layer of its denoiser (message names the file's
            position and the denoiser), or with text-encoder parts the pipeline has no encoder for
            (their keys named; nothing is fused).
    """
    denoisers = find_denoisers(pipeline, denoiser_attrs)
    if len(adapters) > len(denoisers):
        raise ConfigError(f"{len(adapters)} LoRA files for {len(denoisers)} denoiser(s) {list(denoisers)}")
    scales = [1.0] * len(adapters) if scales is None else list(scales)
    if len(scales) != len(adapters):
        raise ConfigError(f"{len(adapters)} LoRA files but {len(scales)} scales")
    encoders = find_text_encoders(pipeline)
    parsed = [_as_adapter(source, None) for source in adapters]
    for adapter in parsed:
        missing = [c for c in adapter.text_encoders if c not in encoders]
        if missing:
            why = f"the pipeline has text encoders {list(encoders)}"
            raise LoRAFormatError(text_encoder_parts_refusal(adapter, why, missing))
    result: dict[str, list[str]] = {}
    for i, ((attr, module), adapter, value) in enumerate(
        zip(denoisers.items(), parsed, scales, strict=False)
    ):
        where = attr
        try:
            result[attr] = fuse_lora_into_model(module, replace(adapter, text_encoders={}), value)
            for where, part in adapter.text_encoders.items():
                fitted = replace(
                    part, modules=fit_part_to_encoder(part.modules, encoders[where]), raw_state_dict=None
                )
                holder = types.SimpleNamespace(**{where: encoders[where]})
                names = fuse_lora_into_model(
                    holder, fitted, value, stacked_params_mapping=[], denoiser_attrs=(where,)
                )
                result.setdefault(where, []).extend(names)
        except OmniUserError as exc:
            raise restate(exc, f"LoRA file {i} of {len(adapters)} (fused into {where!r})") from exc
    return result
