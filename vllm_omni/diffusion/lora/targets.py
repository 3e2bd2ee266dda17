"""Which layers of a denoiser an adapter binds to, and how.

:class:`TargetIndex` lists the supported linear layers of one or more denoisers under *qualified
names* (the module name inside the first denoiser; ``"<attr>.<name>"`` for further denoisers such as
``transformer_2``) and, from the model's ``stacked_params_mapping``, the names of the sub-layers that
were packed into each of them (``to_q`` -> slice ``q`` of ``to_qkv``).

:func:`bind_adapter` turns a format-neutral :class:`~.adapter.LoRAAdapterWeights` into per-layer
:class:`~.weights.LayerLoRAWeights` (unsharded, ``s`` folded into ``B``), and refuses adapters that do
not fit: unmatched module names, ranks above ``max_rank``, wrong shapes, or a packed layer targeted
both whole and per sub-layer.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from vllm_omni.diffusion.lora.adapter import (
    DEFAULT_STRIP_PREFIXES,
    LoRAAdapterWeights,
    LoRAFormatError,
    LoRAModuleWeights,
    candidate_module_keys,
)
from vllm_omni.diffusion.lora.diagnostics import explain_unmatched, key_prefixes
from vllm_omni.diffusion.lora.formats.model_keys import prepare_adapter_for_model
from vllm_omni.diffusion.lora.geometry import LayerGeometry
from vllm_omni.diffusion.lora.layers import BaseLayerWithLoRA, wrapper_class_for
from vllm_omni.diffusion.lora.weights import LayerLoRAWeights
from vllm_omni.errors import ConfigError
from vllm_omni.lora.adapter_files import listing as key_listing

StackedParamsMapping = Sequence[tuple[str, str, str | int]]


@dataclass
class LoRATarget:
    """A patchable linear layer.

    Attributes:
        name: qualified name.
        module: the base layer (unwrapped).
        geometry: its :class:`~.geometry.LayerGeometry` on this rank.
        parent: module holding it, and ``attr``: its attribute name there (used to swap in a wrapper).
        layer_cls: the LoRA layer class that replaces it.
    """

    name: str
    module: nn.Module
    geometry: LayerGeometry
    parent: nn.Module
    attr: str
    layer_cls: type[BaseLayerWithLoRA]


def _replace_suffix(name: str, suffix: str, replacement: str) -> str | None:
    if name == suffix:
        return replacement
    if name.endswith("." + suffix):
        return name[: -len(suffix)] + replacement
    return None


def normalize_packed_mapping(mapping: StackedParamsMapping | None) -> list[tuple[str, str, str | int]]:
    """A packed-layer mapping with vLLM's dotted spelling (``(".to_qkv", ".to_q", "q")``) turned into
    the bare one (``("to_qkv", "to_q", "q")``); bare entries pass unchanged, duplicates are dropped.

    Raises:
        ConfigError: an entry that is not ``(packed_name, sub_name, shard_id)`` with non-empty names.
    """
    out: list[tuple[str, str, str | int]] = []
    for entry in mapping or ():
        if not isinstance(entry, tuple | list) or len(entry) != 3:
            raise ConfigError(
                f"stacked_params_mapping entry {entry!r} is not (packed_name, sub_name, shard_id)"
            )
        packed, sub, shard_id = entry
        if (
            not isinstance(packed, str)
            or not isinstance(sub, str)
            or not packed.strip(".")
            or not sub.strip(".")
        ):
            raise ConfigError(
                f"stacked_params_mapping entry {tuple(entry)!r}: names must be non-empty strings"
            )
        bare = (packed.strip("."), sub.strip("."), shard_id)
        if bare not in out:
            out.append(bare)
    return out


def _suffix_match(name: str, suffixes: Iterable[str]) -> bool:
    return any(_replace_suffix(name, s.strip("."), "") is not None for s in suffixes)


class TargetIndex:
    """Supported linear layers of the denoiser(s), plus packed sub-layer names.

    Args:
        denoisers: ``{attr: module}`` in priority order; the first one's names are unprefixed.
        stacked_params_mapping: ``(packed_name, sub_name, shard_id)`` tuples declared by the model, in
            the bare spelling (``"to_qkv"``) or vLLM's dotted one (``".to_qkv"``).
        target_modules: optional name suffixes; only layers whose qualified name ends with one of
            them (on a dot boundary) are indexed. A suffix naming a packed layer's sub-layer
            (``"to_q"`` for a packed ``to_qkv``) indexes that slice only: the packed layer is wrapped,
            and adapters may fill the named slices, not the whole layer. ``None`` indexes every
            supported linear layer.
        strip_prefixes: key prefixes tried away when resolving adapter keys.

    Attributes:
        targets: qualified name -> :class:`LoRATarget` (every layer to wrap).
        packed: qualified sub-layer name -> ``(packed layer name, slice index)``.
        slice_only: packed layers indexed for some sub-layers only (not addressable whole).

    Raises:
        ConfigError: a mapping entry's shard id does not exist on the packed layer it names; a
            ``target_modules`` entry that selects no layer or sub-layer (the nearest names are given).
    """

    def __init__(
        self,
        denoisers: Mapping[str, nn.Module],
        stacked_params_mapping: StackedParamsMapping | None = None,
        target_modules: Iterable[str] | None = None,
        strip_prefixes: Sequence[str] = DEFAULT_STRIP_PREFIXES,
    ) -> None:
        self.targets: dict[str, LoRATarget] = {}
        self.packed: dict[str, tuple[str, int]] = {}
        self.slice_only: set[str] = set()
        self.denoiser_modules: list[nn.Module] = list(denoisers.values())
        self.strip_prefixes = tuple(strip_prefixes)
        suffixes = tuple(target_modules) if target_modules is not None else None
        layers = self._supported_layers(denoisers)
        for name, target in layers.items():
            if suffixes is None or _suffix_match(name, suffixes):
                self.targets[name] = target
        for packed_name, sub_name, shard_id in normalize_packed_mapping(stacked_params_mapping):
            for qualified, target in layers.items():
                sub_qualified = _replace_suffix(qualified, packed_name, sub_name)
                if sub_qualified is None or sub_qualified in layers:
                    continue
                whole = qualified in self.targets and qualified not in self.slice_only
                if not whole and not _suffix_match(sub_qualified, suffixes or ()):
                    continue
                if shard_id not in target.geometry.shard_ids:
                    raise ConfigError(
                        f"stacked_params_mapping entry ({packed_name!r}, {sub_name!r}, {shard_id!r}): layer "
                        f"{qualified!r} ({type(target.module).__name__}) has no shard {shard_id!r}; "
                        f"known shards: {sorted(target.geometry.shard_ids, key=str)}"
                    )
                if not whole:
                    self.targets[qualified] = target
                    self.slice_only.add(qualified)
                self.packed[sub_qualified] = (qualified, target.geometry.shard_ids[shard_id])
        self._leaves: dict[str, list[str]] | None = None
        if suffixes is not None:
            self._check_target_modules(suffixes, layers, stacked_params_mapping)

    def _check_target_modules(
        self, suffixes: Sequence[str], layers: Mapping[str, LoRATarget], mapping: StackedParamsMapping | None
    ) -> None:
        """Refuse ``target_modules`` entries that select no layer or sub-layer (the manager would wrap
        nothing for them and say nothing), naming the nearest names the model offers."""
        selectable = self.names()
        unused = [s for s in suffixes if not any(_suffix_match(n, [s]) for n in selectable)]
        if not suffixes:
            raise ConfigError("target_modules is empty: it selects no layer (pass None for every layer)")
        if not unused:
            return
        offered = sorted(
            {n.rsplit(".", 1)[-1] for n in layers} | {sub for _, sub, _ in normalize_packed_mapping(mapping)}
        )
        hints = []
        for suffix in unused:
            near = difflib.get_close_matches(suffix.rsplit(".", 1)[-1], offered, n=3, cutoff=0.5)
            hints.append(f"{suffix!r}" + (f" (did you mean {' or '.join(map(repr, near))}?)" if near else ""))
        raise ConfigError(
            f"target_modules {', '.join(hints)} select(s) no LoRA-capable layer of the model; its layers "
            f"and packed sub-layers end with: {offered[:24]}"
        )

    @staticmethod
    def _supported_layers(denoisers: Mapping[str, nn.Module]) -> dict[str, LoRATarget]:
        layers: dict[str, LoRATarget] = {}
        for position, (attr, denoiser) in enumerate(denoisers.items()):
            prefix = "" if position == 0 else f"{attr}."
            for name, module in list(denoiser.named_modules()):
                if not name:
                    continue
                base = module.base_layer if isinstance(module, BaseLayerWithLoRA) else module
                layer_cls = wrapper_class_for(base)
                if layer_cls is None or ".base_layer" in f".{name}":
                    continue
                parent_name, _, child = name.rpartition(".")
                parent = denoiser.get_submodule(parent_name) if parent_name else denoiser
                geometry = layer_cls.geometry_of(base)
                layers[prefix + name] = LoRATarget(prefix + name, base, geometry, parent, child, layer_cls)
        return layers

    def names(self) -> list[str]:
        """Every name an adapter key may resolve to: whole layers (not slice-only) and sub-layers."""
        return [n for n in self.targets if n not in self.slice_only] + list(self.packed)

    def leaf_matches(self, key: str) -> list[str]:
        """The names (:meth:`names`) whose last components are ``key``'s components (``to_out.0`` ->
        ``layers.3.attention.to_out.0``), for each candidate spelling of ``key``; sorted."""
        if self._leaves is None:
            leaves: dict[str, list[str]] = {}
            for name in self.names():
                parts = name.split(".")
                for i in range(1, len(parts)):
                    leaves.setdefault(".".join(parts[i:]), []).append(name)
            self._leaves = leaves
        hits: set[str] = set()
        for candidate in candidate_module_keys(key, self.strip_prefixes):
            hits.update(self._leaves.get(candidate, ()))
        return sorted(hits)

    def _exact(self, name: str) -> tuple[str, int | None] | None:
        if name in self.targets and name not in self.slice_only:
            return name, None
        if name in self.packed:
            return self.packed[name]
        return None

    def resolve(self, key: str) -> tuple[str, int | None] | None:
        """Map an adapter module key to ``(target name, slice index or None for the whole layer)``.

        The key is tried as written and without wrapper prefixes (:func:`~.adapter.candidate_module_keys`);
        failing that, a key that names exactly one layer or sub-layer by its last components (a leaf
        key such as ``to_q`` on a model with one ``to_q``) resolves to it. ``None`` when nothing (or
        more than one layer, for a leaf key) matches.
        """
        for candidate in candidate_module_keys(key, self.strip_prefixes):
            hit = self._exact(candidate)
            if hit is not None:
                return hit
        leaves = self.leaf_matches(key)
        return self._exact(leaves[0]) if len(leaves) == 1 else None


def _resolve_modules(
    adapter: LoRAAdapterWeights, index: TargetIndex
) -> dict[str, tuple[str, int | None, LoRAModuleWeights]]:
    """Each module key of ``adapter`` -> ``(target, slice index or None, weights)``.

    Raises:
        LoRAFormatError: unmatched keys (each explained by :func:`~.diagnostics.explain_unmatched`),
            or an adapter without modules.
    """
    source = adapter.source
    resolved: dict[str, tuple[str, int | None, LoRAModuleWeights]] = {}
    unmatched: list[str] = []
    for key, weights in adapter.modules.items():
        hit = index.resolve(key)
        if hit is None:
            unmatched.append(key)
        else:
            resolved[key] = (hit[0], hit[1], weights)
    if unmatched:
        what = (
            "none of its modules" if not resolved else f"{len(unmatched)} of {len(adapter.modules)} modules"
        )
        matched = ""
        if resolved:  # what the others bound to, as written -> the layer (so a near miss is plain)
            shown = ", ".join(f"{k!r} -> {t!r}" for k, (t, _, _) in sorted(resolved.items())[:3])
            matched = f"; matched: {shown}" + (f" (+{len(resolved) - 3} more)" if len(resolved) > 3 else "")
        raise LoRAFormatError(
            f"{source}: {what} match a LoRA-capable layer of the model; unmatched: {key_listing(unmatched)}"
            f"{matched}; " + explain_unmatched(unmatched, index.names(), index.leaf_matches)
        )
    if not resolved:
        raise LoRAFormatError(
            f"{source}: the adapter has no LoRA modules, so it would bind no layer and change nothing; "
            f"keys here start with {key_prefixes(index.names()) or 'nothing (no layer is selected)'}"
        )
    return resolved


def bind_adapter(
    adapter: LoRAAdapterWeights, index: TargetIndex, max_rank: int | None = None
) -> dict[str, LayerLoRAWeights]:
    """Bind an adapter's modules to the indexed layers.

    Returns:
        target name -> :class:`~.weights.LayerLoRAWeights` with ``s * B`` folded in (float32, CPU).
        A sub-layer adapter fills only its slice; the other slices of the packed layer stay ``None``
        (exactly zero). An adapter keyed by the packed layer's own name fills every slice from the
        row-split ``B`` with one shared ``A``. A module's ``lora_bias`` (lightx2v ``diff_b``) is bound
        beside it as ``s * b`` per slice (``LayerLoRAWeights.biases``).

    Raises:
        LoRAFormatError: an adapter without modules (it would change nothing); names of modules that
            bind to nothing, each with what the model offers instead (:mod:`.diagnostics`); a LoRA rank above ``max_rank`` (module,
            its rank and the limit); shape mismatches; a packed layer targeted both whole and per
            slice, or one slice targeted twice.
    """
    adapter = prepare_adapter_for_model(
        adapter,
        index.denoiser_modules,
        index.names(),
        lambda k: index.resolve(k) is not None,
    )
    source = adapter.source
    resolved = _resolve_modules(adapter, index)
    too_big = [
        (k, w.rank)
        for k, (_, _, w) in resolved.items()
        if max_rank is not None and w.kind == "lora" and w.rank > max_rank
    ]
    if too_big:
        listing = ", ".join(f"{k} (rank {r})" for k, r in sorted(too_big))
        raise LoRAFormatError(f"{source}: LoRA rank above the configured max_rank {max_rank}: {listing}")

    per_target: dict[str, dict[int | None, tuple[str, LoRAModuleWeights]]] = {}
    for key, (target, slice_index, weights) in resolved.items():
        entries = per_target.setdefault(target, {})
        if slice_index in entries or (slice_index is None and entries) or (None in entries):
            others = [k for k, _ in entries.values()]
            raise LoRAFormatError(f"{source}: {key!r} and {others} target the same part of layer {target!r}")
        entries[slice_index] = (key, weights)

    bound: dict[str, LayerLoRAWeights] = {}
    for target, entries in per_target.items():
        geometry = index.targets[target].geometry
        slices: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(geometry.slices)
        if None in entries:
            key, weights = entries[None]
            _check_shape(key, weights, geometry.in_features, geometry.out_features, source)
            scaled_b, bias = weights.scaled_b(), _scaled_bias(weights)
            cuts = [slice(sl.global_offset, sl.global_offset + sl.global_size) for sl in geometry.slices]
            slices = [(weights.lora_a, scaled_b[cut].contiguous()) for cut in cuts]
            bound[target] = LayerLoRAWeights(
                tuple(slices),
                shared_a=len(slices) > 1,
                rank_limited=weights.kind == "lora",
                biases=None if bias is None else tuple(bias[cut].contiguous() for cut in cuts),
            )
            continue
        slice_biases: list[torch.Tensor | None] = [None] * len(geometry.slices)
        for slice_index, (key, weights) in entries.items():
            assert slice_index is not None
            sl = geometry.slices[slice_index]
            _check_shape(key, weights, geometry.in_features, sl.global_size, source)
            slices[slice_index] = (weights.lora_a, weights.scaled_b())
            slice_biases[slice_index] = _scaled_bias(weights)
        limited = all(weights.kind == "lora" for _, weights in entries.values())
        has_bias = any(b is not None for b in slice_biases)
        bound[target] = LayerLoRAWeights(
            tuple(slices),
            shared_a=False,
            rank_limited=limited,
            biases=tuple(slice_biases) if has_bias else None,
        )
    return bound


def _scaled_bias(weights: LoRAModuleWeights) -> torch.Tensor | None:
    """``s * b`` (peft scales ``lora_B``'s bias with its output), float32, or ``None``."""
    return None if weights.lora_bias is None else weights.lora_bias.float() * weights.scaling


def _check_shape(
    key: str, weights: LoRAModuleWeights, in_features: int, out_features: int, source: str
) -> None:
    if weights.kind != "lora" and (weights.in_features, weights.out_features) != (in_features, out_features):
        raise LoRAFormatError(
            f"{source}: {weights.kind} module {key!r} makes an update of shape "
            f"{(weights.out_features, weights.in_features)} but the layer's weight is {(out_features, in_features)}"
        )
    if weights.in_features != in_features or weights.out_features != out_features:
        r = weights.rank
        raise LoRAFormatError(
            f"{source}: module {key!r} has lora_A {tuple(weights.lora_a.shape)} / lora_B "
            f"{tuple(weights.lora_b.shape)} but the layer expects inputs {in_features} and outputs {out_features}, "
            f"i.e. lora_A {(r, in_features)} / lora_B {(out_features, r)} (adapter trained for another model or size?)"
        )


DEFAULT_DENOISER_ATTRS: tuple[str, ...] = ("transformer", "transformer_2")


def find_denoisers(model_or_pipeline: object, denoiser_attrs: Sequence[str] = DEFAULT_DENOISER_ATTRS) -> dict:
    """The denoiser modules of a model or pipeline, ``{name: module}``, first one primary.

    A module that declares ``stacked_params_mapping`` is a denoiser itself; otherwise the attributes
    named in ``denoiser_attrs`` that hold modules are used; otherwise a bare ``nn.Module`` is taken
    as the denoiser.

    Raises:
        TypeError: nothing usable was found.
    """
    if isinstance(model_or_pipeline, nn.Module) and hasattr(model_or_pipeline, "stacked_params_mapping"):
        return {"": model_or_pipeline}
    found = {
        attr: getattr(model_or_pipeline, attr)
        for attr in denoiser_attrs
        if isinstance(getattr(model_or_pipeline, attr, None), nn.Module)
    }
    if found:
        return found
    if isinstance(model_or_pipeline, nn.Module):
        return {"": model_or_pipeline}
    raise TypeError(
        f"{type(model_or_pipeline).__name__} is neither an nn.Module nor a pipeline with one of {list(denoiser_attrs)}"
    )


def mapping_from_models(denoisers: Mapping[str, nn.Module]) -> list[tuple[str, str, str | int]]:
    """The packed-layer mappings the denoisers declare (``stacked_params_mapping``), each entry once."""
    mapping: list[tuple[str, str, str | int]] = []
    for module in denoisers.values():
        for entry in getattr(module, "stacked_params_mapping", None) or ():
            if tuple(entry) not in mapping:
                mapping.append(tuple(entry))
    return mapping
