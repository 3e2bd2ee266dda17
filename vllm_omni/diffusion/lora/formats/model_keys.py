"""Resolve an adapter's module names against the model it is bound to.

Two mechanisms, tried in this order when an adapter is bound (:func:`prepare_adapter_for_model`):

1. **diffusers' converter for the model family.** diffusers ships key converters for non-diffusers
   LoRA files (kohya ``lora_unet_``, ComfyUI ``diffusion_model.``, per-module ``.alpha``) in
   ``diffusers.loaders.lora_conversion_utils``, and each pipeline's ``LoraLoaderMixin.lora_state_dict``
   decides when to run one. :data:`FAMILY_CONVERTERS` repeats those decisions, keyed by the denoiser's
   class name, and runs diffusers' own function on the file's tensors; the result (diffusers keys,
   alpha folded into the weights, so ``s = 1``) is parsed like any diffusers file. Only files without
   a PEFT configuration are converted (a configuration's alpha / patterns are not ``.alpha`` keys).
2. **Generic kohya un-flattening** for models without a converter: ``lora_unet_<path with _>`` is
   matched against the model's own LoRA-capable layer names (and the sub-layer names of packed
   layers) with ``.`` replaced by ``_``; a flattened name that fits two layers, or none, is an error.

Adapters whose names already are the model's (PEFT, diffusers, ComfyUI with diffusers names) pass
through unchanged; wrapper prefixes are stripped by :func:`..adapter.candidate_module_keys`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from vllm_omni.diffusion.lora.adapter import LoRAAdapterWeights
from vllm_omni.diffusion.lora.formats.layouts import (
    COMFYUI_PREFIX,
    KOHYA_UNET_PREFIX,
    key_refusal,
    strip_kohya_prefix,
)
from vllm_omni.diffusion.lora.safetensors_format import adapter_from_state_dict
from vllm_omni.errors import LoRAFormatError

logger = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class FamilyConverter:
    """diffusers' key converter for one model family.

    Attributes:
        name: family name (for messages).
        model_classes: denoiser class names it applies to (diffusers' and the in-tree model share them).
        applies: when diffusers' ``lora_state_dict`` for that family would run the converter.
        function: name of the converter in ``diffusers.loaders.lora_conversion_utils``.
        reads_deltas: the converter reads lightx2v ``.diff`` / ``.diff_b`` tensors (into
            ``lora_B.bias`` and LoRA factors, dropping the ones diffusers drops); files with such
            tensors are refused for other families, naming the keys.
    """

    name: str
    model_classes: tuple[str, ...]
    applies: Callable[[Mapping[str, torch.Tensor]], bool]
    function: str
    reads_deltas: bool = False

    def convert(self, state_dict: StateDict) -> StateDict:
        # only when a converter runs: diffusers costs ~0.9 s CPU (measured) in processes that load no
        # diffusers-layout adapter (this module loads with every diffusion stage's LoRA manager)
        from diffusers.loaders import lora_conversion_utils

        return getattr(lora_conversion_utils, self.function)(dict(state_dict))


def _any_key(predicate: Callable[[str], bool]) -> Callable[[Mapping[str, torch.Tensor]], bool]:
    return lambda sd: any(predicate(k) for k in sd)


def _non_diffusers(sd: Mapping[str, torch.Tensor]) -> bool:
    # ZImageLoraLoaderMixin / QwenImageLoraLoaderMixin: alphas, lora_unet_, diffusion_model. or default.
    return any(
        k.endswith(".alpha") or k.startswith((KOHYA_UNET_PREFIX, COMFYUI_PREFIX)) or "default." in k
        for k in sd
    )


#: Families whose diffusers converter we run, mirroring each pipeline's ``lora_state_dict`` trigger.
#: Z-Image, Qwen-Image and Wan have in-tree models (their converters are covered by parity tests against
#: diffusers); the others apply to diffusers denoisers of those families loaded through the fallback path.
FAMILY_CONVERTERS: list[FamilyConverter] = [
    FamilyConverter(
        "Z-Image",
        ("ZImageTransformer2DModel",),
        _non_diffusers,
        "_convert_non_diffusers_z_image_lora_to_diffusers",
    ),
    FamilyConverter(
        "Qwen-Image",
        ("QwenImageTransformer2DModel",),
        _non_diffusers,
        "_convert_non_diffusers_qwen_lora_to_diffusers",
    ),
    FamilyConverter(
        "Flux",
        ("FluxTransformer2DModel",),
        _any_key(lambda k: k.endswith(".lora_down.weight")),
        "_convert_kohya_flux_lora_to_diffusers",
    ),
    FamilyConverter(  # FluxLoraLoaderMixin: XLabs files, read after kohya's
        "Flux (XLabs)",
        ("FluxTransformer2DModel",),
        _any_key(lambda k: "processor" in k),
        "_convert_xlabs_flux_lora_to_diffusers",
    ),
    FamilyConverter(
        "Wan",
        ("WanTransformer3DModel",),
        _any_key(lambda k: k.startswith(COMFYUI_PREFIX)),
        "_convert_non_diffusers_wan_lora_to_diffusers",
        reads_deltas=True,
    ),
    FamilyConverter(
        "Wan (musubi)",
        ("WanTransformer3DModel",),
        _any_key(lambda k: k.startswith(KOHYA_UNET_PREFIX)),
        "_convert_musubi_wan_lora_to_diffusers",
    ),
    FamilyConverter(
        "Lumina2",
        ("Lumina2Transformer2DModel",),
        _any_key(lambda k: k.startswith(COMFYUI_PREFIX)),
        "_convert_non_diffusers_lumina2_lora_to_diffusers",
    ),
]


def register_family_converter(converter: FamilyConverter, *, first: bool = True) -> None:
    """Add a family converter (ahead of the built-in ones unless ``first=False``)."""
    if first:
        FAMILY_CONVERTERS.insert(0, converter)
    else:
        FAMILY_CONVERTERS.append(converter)


def find_family_converter(
    denoisers: Iterable[nn.Module], state_dict: Mapping[str, torch.Tensor]
) -> FamilyConverter | None:
    """The first converter registered for the primary denoiser's class whose trigger accepts the keys."""
    denoisers = list(denoisers)
    if not denoisers:
        return None
    class_names = {cls.__name__ for cls in type(denoisers[0]).__mro__}
    for converter in FAMILY_CONVERTERS:
        if class_names & set(converter.model_classes) and converter.applies(state_dict):
            return converter
    return None


def convert_with_family(adapter: LoRAAdapterWeights, converter: FamilyConverter) -> LoRAAdapterWeights:
    """Run diffusers' converter on the adapter's stored tensors and parse the result (``s = 1``: the
    converter folds each module's ``alpha / r`` into its weights).

    A file's ``.diff`` / ``.diff_b`` tensors (:attr:`~..adapter.LoRAAdapterWeights.deltas`) are read as
    diffusers reads them: the ones its converter keeps become ``lora_bias`` (``diff_b``) or LoRA factors
    (Wan's ``head.head.diff``: ``A`` = the delta, ``B`` = identity, kind ``"diff"``, exempt from
    ``max_rank`` as LoHa / LoKr equivalents are); the ones it drops (norm and
    modulation deltas, ...) are dropped here too, with a warning naming them.

    Raises:
        LoRAFormatError: the converter rejects the file (its message and the file are named).
    """
    raw = adapter.raw_state_dict
    assert raw is not None
    try:
        converted = converter.convert(raw)
    except (KeyError, ValueError, RuntimeError, IndexError, AssertionError) as exc:  # Flux's asserts sizes
        raise LoRAFormatError(
            f"{adapter.source}: diffusers' {converter.name} LoRA converter ({converter.function}) could not read "
            f"this {adapter.layout} file: {type(exc).__name__}: {exc}"
        ) from exc
    parsed = adapter_from_state_dict(converted, source=adapter.source, lora_biases=bool(adapter.deltas))
    kept = {id(t) for t in converted.values()}  # the converter moves tensors, it does not copy them
    full = {id(raw[k]) for k in adapter.deltas if k.endswith(".diff")}
    for key, tensor in converted.items():  # a full delta as A (identity B): not bound by max_rank
        module = key.removesuffix(".lora_A.weight")
        if module != key and id(tensor) in full and module in parsed.modules:
            parsed.modules[module] = replace(parsed.modules[module], kind="diff")
    dropped = [k for k in adapter.deltas if id(raw[k]) not in kept]
    if dropped:
        logger.warning(
            "%s: %d of %d .diff/.diff_b tensors are not applied (diffusers' %s drops them too): %s",
            adapter.source,
            len(dropped),
            len(adapter.deltas),
            converter.function,
            dropped[:8] + ([f"... {len(dropped) - 8} more"] if len(dropped) > 8 else []),
        )
    return replace(parsed, layout=adapter.layout, raw_state_dict=None, deltas=list(adapter.deltas))


def flattened_names(names: Iterable[str]) -> dict[str, list[str]]:
    """kohya's flattening (every ``.`` -> ``_``) of each name -> the names that flatten to it."""
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(name.replace(".", "_"), []).append(name)
    return out


def unflatten_kohya(adapter: LoRAAdapterWeights, names: Iterable[str]) -> LoRAAdapterWeights:
    """Rename ``lora_unet_<flat>`` modules to the model's names (``names``: layers and packed sub-layers).

    Raises:
        LoRAFormatError: flattened names that match no layer, or more than one (all named).
    """
    table = flattened_names(names)
    modules = {}
    unmatched: list[str] = []
    ambiguous: list[str] = []
    for key, weights in adapter.modules.items():
        flat = strip_kohya_prefix(key)
        if flat is None:
            modules[key] = weights
            continue
        hits = table.get(flat, [])
        if len(hits) == 1:
            modules[hits[0]] = weights
        elif hits:
            ambiguous.append(f"{key} -> {sorted(hits)}")
        else:
            unmatched.append(key)
    if ambiguous:
        raise LoRAFormatError(f"{adapter.source}: kohya names that fit several layers: {ambiguous[:12]}")
    if unmatched:
        shown = sorted(unmatched)
        raise LoRAFormatError(
            f"{adapter.source}: {len(unmatched)} of {len(adapter.modules)} kohya modules match no LoRA-capable "
            f"layer of the model once un-flattened; unmatched: {shown[:20]}"
            + (f" (+{len(shown) - 20} more)" if len(shown) > 20 else "")
        )
    return replace(adapter, modules=modules, raw_state_dict=None)


def _model_name(module: nn.Module) -> str | None:
    for attr in ("name_or_path", "_name_or_path"):
        value = getattr(module, attr, None)
        if isinstance(value, str) and value:
            return value
    config = getattr(module, "config", None)
    value = getattr(config, "_name_or_path", None) if config is not None else None
    return value if isinstance(value, str) and value else None


def _same_model(a: str, b: str) -> bool:
    def norm(s: str) -> tuple[str, ...]:
        parts = [p for p in os.path.normpath(s.rstrip("/")).split(os.sep) if p and p != "transformer"]
        return tuple(parts[-2:])

    return a == b or norm(a) == norm(b) or norm(a)[-1:] == norm(b)[-1:]


def prepare_adapter_for_model(
    adapter: LoRAAdapterWeights,
    denoisers: Iterable[nn.Module],
    names: Iterable[str],
    resolves: Callable[[str], bool],
) -> LoRAAdapterWeights:
    """Turn a parsed adapter into one whose module keys the model's layer index can resolve.

    Args:
        adapter: as read from disk.
        denoisers: the denoiser modules, primary first (their class picks the family converter).
        names: qualified names of the LoRA-capable layers and packed sub-layers.
        resolves: whether the layer index resolves a module key.

    Raises:
        LoRAFormatError: the converter or un-flattening fails; ``.diff`` / ``.diff_b`` tensors for a model
            whose converter does not read them (keys named); or every module resolves but some
            carry tensors the configuration's ``target_modules`` does not select (peft would ignore
            them, so applying them would not match peft).
    """
    denoisers = list(denoisers)
    if adapter.base_model_name_or_path and denoisers:
        model_name = _model_name(denoisers[0])
        if model_name and not _same_model(model_name, adapter.base_model_name_or_path):
            logger.warning(
                "%s: LoRA config says it was trained on %r but the model is %r; loading it anyway (shapes match)",
                adapter.source,
                adapter.base_model_name_or_path,
                model_name,
            )
    if adapter.raw_state_dict is not None and not adapter.has_config:
        converter = find_family_converter(denoisers, adapter.raw_state_dict)
        if converter is not None and (converter.reads_deltas or not adapter.deltas):
            return convert_with_family(adapter, converter)
    if adapter.deltas:
        raise key_refusal(adapter.deltas, adapter.source, "; diffusers reads them for Wan models only")
    if adapter.layout == "kohya":
        adapter = unflatten_kohya(adapter, names)
    if adapter.untargeted and all(resolves(k) for k in adapter.modules):
        raise LoRAFormatError(
            f"{adapter.source}: tensors for modules that the config's target_modules does not select (peft would "
            f"ignore them): {sorted(adapter.untargeted)[:20]}; fix target_modules or drop those tensors"
        )
    return adapter
