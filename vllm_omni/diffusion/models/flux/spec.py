"""The Flux family (FLUX.1-dev / schnell / Kontext): the pipeline classes it serves in-tree.

Its published checkpoints (``PUBLISHED``, the contract test's folders) and the move of its pipelines onto
:class:`~vllm_omni.diffusion.pipelines.template.DiTPipeline` come with the Flux port (``tools/make_tiny_flux.py``
holds its published scheduler and transformer keys today).
"""

from __future__ import annotations

from vllm_omni.config.dit_family import DiTFamilySpec, PublishedCheckpoint

PUBLISHED: tuple[PublishedCheckpoint, ...] = ()

SPEC = DiTFamilySpec(
    name="flux",
    pipelines={
        "FluxPipeline": "vllm_omni.diffusion.pipelines.flux:FluxPipeline",
        "FluxKontextPipeline": "vllm_omni.diffusion.pipelines.flux_kontext:FluxKontextPipeline",
    },
    published=PUBLISHED,
    inputs=("image",),
    image_inputs={"FluxKontextPipeline": "optional"},
)

__all__ = ["PUBLISHED", "SPEC"]
