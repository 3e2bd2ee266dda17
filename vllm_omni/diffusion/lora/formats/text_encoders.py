"""Text-encoder parts of a LoRA file: which keys belong to which text encoder, as diffusers names them.

A single LoRA file (SD / SDXL / SD3 / Flux / Z-Image LoRAs trained with kohya-ss or diffusers) may carry,
beside its denoiser part, one part per text encoder of the pipeline. The components are the pipeline's
attributes, as diffusers' loaders name them (``StableDiffusion3Pipeline._lora_loadable_modules``:
``text_encoder``, ``text_encoder_2``; ``load_lora_into_text_encoder(prefix=...)``):

* diffusers / PEFT keys (``save_lora_weights``): ``text_encoder.<module>.lora_A.weight`` and
  ``text_encoder_2.<module>...`` (and ``text_encoder_3.``), with the LoRA configuration of each component
  under ``<component>.`` in the ``lora_adapter_metadata`` header;
* kohya-ss sd-scripts (what A1111 / ComfyUI read): ``lora_te_<flat>`` for a pipeline with one text encoder,
  ``lora_te1_<flat>`` / ``lora_te2_<flat>`` (/ ``lora_te3_``) for the first / second (/ third) one, with
  ``lora_down`` / ``lora_up`` and a per-module ``.alpha`` (``s = alpha / r``), as diffusers'
  ``lora_conversion_utils._convert_non_diffusers_lora_to_diffusers`` maps them (``lora_te_`` and
  ``lora_te1_`` -> ``text_encoder``, ``lora_te2_`` -> ``text_encoder_2``).

:func:`split_text_encoder_parts` separates them; each part keeps its keys relative to the encoder: a
kohya part is rewritten under the generic flattened prefix (``lora_unet_<flat>``) so that it is
un-flattened against the encoder's own ``nn.Linear`` names when it is bound (:mod:`.model_keys`),
exactly as a denoiser's kohya keys are. :func:`fit_part_to_encoder` drops the ``text_model.`` level
that older CLIP checkpoints name and transformers 5's flattened ``CLIPTextModel`` lacks (as diffusers'
``_load_lora_into_text_encoder`` does).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from vllm_omni.diffusion.lora.formats.layouts import KOHYA_UNET_PREFIX
from vllm_omni.lora.adapter_files import listing

#: kohya prefix -> the diffusers component it names (longest prefixes first).
KOHYA_TEXT_ENCODER_PREFIXES: tuple[tuple[str, str], ...] = (
    ("lora_te1_", "text_encoder"),
    ("lora_te2_", "text_encoder_2"),
    ("lora_te3_", "text_encoder_3"),
    ("lora_te_", "text_encoder"),
)
#: the diffusers components whose ``<component>.`` key prefix a file may use.
TEXT_ENCODER_COMPONENTS: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")
_CLIP_TEXT_MODEL = "text_model"

StateDict = dict[str, torch.Tensor]


def text_encoder_component(key: str) -> tuple[str, str] | None:
    """``(component, key within the part)`` of a text-encoder key, else ``None`` (a denoiser key).

    ``text_encoder.m.lora_A.weight`` -> ``("text_encoder", "m.lora_A.weight")``;
    ``lora_te2_a_b.alpha`` -> ``("text_encoder_2", "lora_unet_a_b.alpha")`` (the kohya form read by the
    generic un-flattening).
    """
    for prefix, component in KOHYA_TEXT_ENCODER_PREFIXES:
        if key.startswith(prefix):
            return component, KOHYA_UNET_PREFIX + key[len(prefix) :]
    for component in TEXT_ENCODER_COMPONENTS:
        if key.startswith(component + "."):
            return component, key[len(component) + 1 :]
    return None


def split_text_encoder_parts(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[StateDict, dict[str, StateDict]]:
    """``(denoiser part, {component: text-encoder part})`` of a file's tensors (same tensor objects).

    Components come in first-seen order; a file without text-encoder keys gives ``(all, {})``.
    """
    denoiser: StateDict = {}
    parts: dict[str, StateDict] = {}
    for key, tensor in state_dict.items():
        found = text_encoder_component(key)
        if found is None:
            denoiser[key] = tensor
        else:
            parts.setdefault(found[0], {})[found[1]] = tensor
    return denoiser, parts


def fit_part_to_encoder(part: Mapping[str, torch.Tensor], encoder: nn.Module) -> StateDict:
    """``part`` with the ``text_model.`` level removed from its keys (``text_model_`` in flattened kohya
    keys) when ``encoder`` has no ``text_model`` child (transformers 5 flattens ``CLIPTextModel``), as
    diffusers' ``_load_lora_into_text_encoder`` does; unchanged otherwise."""
    if isinstance(getattr(encoder, _CLIP_TEXT_MODEL, None), nn.Module):
        return dict(part)
    flat = KOHYA_UNET_PREFIX + _CLIP_TEXT_MODEL + "_"
    out: StateDict = {}
    for key, tensor in part.items():
        if key.startswith(_CLIP_TEXT_MODEL + "."):
            key = key[len(_CLIP_TEXT_MODEL) + 1 :]
        elif key.startswith(flat):
            key = KOHYA_UNET_PREFIX + key[len(flat) :]
        out[key] = tensor
    return out


def part_keys(component: str, part) -> list[str]:
    """The module keys of a parsed text-encoder part (a ``LoRAAdapterWeights``) as the file spells them."""
    if part.layout != "kohya":
        return [f"{component}.{key}" for key in sorted(part.modules)]
    prefix = "/".join(p for p, c in KOHYA_TEXT_ENCODER_PREFIXES if c == component)
    return [prefix + key.removeprefix(KOHYA_UNET_PREFIX) for key in sorted(part.modules)]


def text_encoder_parts_refusal(adapter, why: str, components: list[str] | None = None) -> str:
    """The message refusing ``adapter``'s text-encoder parts (``components``, default all), naming their keys."""
    components = list(adapter.text_encoders) if components is None else components
    keys = [k for c in components for k in part_keys(c, adapter.text_encoders[c])]
    return f"{adapter.source}: text-encoder parts for {components} ({why}); keys: {listing(keys)}"


__all__ = [
    "part_keys",
    "text_encoder_parts_refusal",
    "KOHYA_TEXT_ENCODER_PREFIXES",
    "TEXT_ENCODER_COMPONENTS",
    "fit_part_to_encoder",
    "split_text_encoder_parts",
    "text_encoder_component",
]
