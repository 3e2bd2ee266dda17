"""What a DiT family declares about itself: :class:`DiTFamilySpec` and the published checkpoints it serves.

A family (``vllm_omni/diffusion/models/<family>/``) has one ``spec.py`` holding ``SPEC``, a
:class:`DiTFamilySpec`: the pipeline classes it serves and where their in-tree pipelines are, the published
checkpoints it claims (:class:`PublishedCheckpoint`: the behaviour-selecting keys of each published folder),
the config keys that select variants and the values served (:class:`VariantKey`; any other value is refused
at start, :func:`check_variants`), its denoiser names, LoRA targets and converters, CFG layout, inputs, VAE
normalisation and sampling defaults. One registry (:mod:`vllm_omni.config.dit_families`) lists the families.

Pure data (no torch, no diffusers): the config layer reads it before any model is loaded. The tiny makers
(``tools/make_tiny_dit.py``) and the contract test (``tests/diffusion/contract``) build their folders from
the :class:`PublishedCheckpoint` records, shrinking only sizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni.errors import ConfigError


@dataclass(frozen=True)
class PublishedCheckpoint:
    """The behaviour-selecting configuration of one published checkpoint.

    Attributes:
        repo: the hub id (``"Wan-AI/Wan2.2-T2V-A14B-Diffusers"``).
        pipeline: ``model_index.json`` ``_class_name``.
        index_keys: the other non-component keys of ``model_index.json`` (``boundary_ratio``, ...).
        components: component name -> ``(library, class)`` as ``model_index.json`` lists it; a
            component the folder does not ship is absent.
        scheduler: ``scheduler/scheduler_config.json`` (``_class_name`` included).
        denoiser: ``transformer/config.json`` (``_class_name`` included; sizes as published).
        sources: where the values were read (for the reader; nothing parses it).
    """

    repo: str
    pipeline: str
    index_keys: dict[str, Any]
    components: dict[str, tuple[str, str]]
    scheduler: dict[str, Any]
    denoiser: dict[str, Any]
    sources: str = ""

    @property
    def name(self) -> str:
        """The repo's last part (``"Wan2.2-T2V-A14B-Diffusers"``), a test id."""
        return self.repo.rsplit("/", 1)[-1]

    def model_index(self) -> dict[str, Any]:
        """The ``model_index.json`` document (components the folder lacks are omitted)."""
        return {
            "_class_name": self.pipeline,
            **self.index_keys,
            **{name: list(spec) for name, spec in sorted(self.components.items())},
        }


@dataclass(frozen=True)
class VariantKey:
    """A config key that selects a variant and the values the family serves.

    Attributes:
        file: the file inside the model folder (``"model_index.json"``, ``"transformer/config.json"``,
            ``"scheduler/scheduler_config.json"``).
        key: the key in that file.
        served: the values served (``None``: every value). A file or key the folder lacks is not
            checked (the class default applies; the loader names a missing file).
        why: what an unserved value means (named in the refusal).
    """

    file: str
    key: str
    served: tuple[Any, ...] | None = None
    why: str = ""


@dataclass(frozen=True)
class DiTFamilySpec:
    """One DiT family (module docstring).

    Attributes:
        name: the registry name (``"wan"``).
        pipelines: ``model_index.json`` ``_class_name`` -> ``"module:Class"`` of its in-tree pipeline.
        published: the published checkpoints the family claims (the contract test builds each).
        variants: the config keys that select variants and the values served.
        denoisers: the denoiser component names (LoRA patches each; two for two-expert checkpoints).
        lora_targets: the denoiser module names adapters target (diffusers names).
        lora_formats: adapter file layouts read besides PEFT / diffusers (converters named).
        cfg: the CFG layout and formula.
        cfg_threshold: CFG runs when the scale is above it (0: Z-Image; 1: the others).
        guidance_argument: the diffusers ``__call__`` argument a request's ``guidance_scale`` stands for.
        inputs: request inputs besides text (``"image"``, ``"last_image"``).
        image_inputs: pipeline class -> ``"required"`` / ``"optional"`` for classes that take an input image.
        output_kind: ``"image"`` or ``"video"`` (video requests take ``extra_args["num_frames"]``).
        vae_normalisation: how latents become VAE inputs.
        defaults: sampling defaults of a request that sets none (``guidance_scale``, ``size``...).
        contract: what the contract test (``tests/diffusion/contract``) applies to both sides to keep tiny
            runs tiny and loadable: ``reference_loaders`` (component -> ``"module:function"`` loading it for
            the diffusers reference, e.g. a processor without torchvision) and ``condition_area``
            (``(pixels, "module:function")``: the in-tree ``condition_area`` and diffusers' sizing function
            patched to use it), ``reference_n1_components`` (with one of these components diffusers'
            reference makes one output per prompt only; the contract then asks for one),
            ``max_sequence_length`` (both sides' prompt length, for families that pad prompts to it).
    """

    name: str
    pipelines: dict[str, str]
    published: tuple[PublishedCheckpoint, ...]
    variants: tuple[VariantKey, ...] = ()
    denoisers: tuple[str, ...] = ("transformer",)
    lora_targets: tuple[str, ...] = ()
    lora_formats: tuple[str, ...] = ()
    cfg: str = ""
    cfg_threshold: float = 1.0
    guidance_argument: str = "guidance_scale"
    inputs: tuple[str, ...] = ()
    image_inputs: dict[str, str] = field(default_factory=dict)
    output_kind: str = "image"
    vae_normalisation: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    contract: dict[str, Any] = field(default_factory=dict)


def _read(root: Path, file: str, cache: dict[str, dict]) -> dict:
    if file not in cache:
        path = root / file
        cache[file] = json.loads(path.read_text()) if path.is_file() else {}
    return cache[file]


def check_variants(spec: DiTFamilySpec, root: str | Path) -> None:
    """Refuse a folder whose config selects a variant ``spec`` does not serve (at start, before loading).

    Raises:
        ConfigError: naming the folder, the file and key, the value and the values served.
    """
    root = Path(root)
    cache: dict[str, dict] = {}
    for variant in spec.variants:
        if variant.served is None:
            continue
        document = _read(root, variant.file, cache)
        if variant.key not in document:  # the class default, which every family serves
            continue
        value = document[variant.key]
        if value in variant.served:
            continue
        why = f" ({variant.why})" if variant.why else ""
        raise ConfigError(
            f"{root}: {variant.file} sets {variant.key}={value!r}{why}, a variant the in-tree {spec.name} "
            f"family does not serve (it serves {list(variant.served)}); run the stage with "
            "pipeline_backend='diffusers' for it",
            options=("model", "pipeline_backend"),
        )


__all__ = ["DiTFamilySpec", "PublishedCheckpoint", "VariantKey", "check_variants"]
