"""The registry of in-tree DiT families: one line per family, naming its spec module.

A family lives in one folder, ``vllm_omni/diffusion/models/<family>/`` (denoiser, pipeline and
``spec.py`` with ``SPEC``, a :class:`~vllm_omni.config.dit_family.DiTFamilySpec`). Adding a family is its
folder plus one line here; the pipeline classes it serves, the variant checks at start and the contract
test (``tests/diffusion/contract``) follow from its spec. Spec modules are pure data and are imported by
name, on first use (the config layer loads no model code).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from functools import cache

from vllm_omni.config.dit_family import DiTFamilySpec

#: family name -> the module holding its ``SPEC``
DIT_FAMILIES: dict[str, str] = {
    "z_image": "vllm_omni.diffusion.models.z_image.spec",
    "qwen_image": "vllm_omni.diffusion.models.qwen_image.spec",
    "wan": "vllm_omni.diffusion.models.wan.spec",
    "flux": "vllm_omni.diffusion.models.flux.spec",
}


@cache
def family_specs() -> dict[str, DiTFamilySpec]:
    """Every registered family's spec, by name (imported once)."""
    return {name: importlib.import_module(module).SPEC for name, module in DIT_FAMILIES.items()}


def family_for_class(class_name: str | None) -> DiTFamilySpec | None:
    """The family serving ``model_index.json`` ``_class_name`` in-tree, else ``None``."""
    for spec in family_specs().values():
        if class_name in spec.pipelines:
            return spec
    return None


class _InTreePipelines(Mapping):
    """``_class_name`` -> ``"module:Class"`` of every family's in-tree pipelines (read on first use)."""

    def _table(self) -> dict[str, str]:
        return {cls: target for spec in family_specs().values() for cls, target in spec.pipelines.items()}

    def __getitem__(self, key: str) -> str:
        return self._table()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __contains__(self, key: object) -> bool:
        return key in self._table()

    def __repr__(self) -> str:
        return repr(self._table())


#: ``model_index.json`` ``_class_name`` -> ``"module:Class"`` of the in-tree pipeline (every family's)
IN_TREE_PIPELINES: Mapping[str, str] = _InTreePipelines()

__all__ = ["DIT_FAMILIES", "IN_TREE_PIPELINES", "family_for_class", "family_specs"]
