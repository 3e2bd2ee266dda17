"""What a published checkpoint's folder says about itself: the record every family's spec lists.

A :class:`PublishedCheckpoint` keeps the key values of one published diffusers folder that select
behaviour (the pipeline class and the non-component keys of ``model_index.json``, which components it
ships, the scheduler's ``scheduler_config.json``, the denoiser's ``config.json``). Sizes are kept as
published too; the tiny makers (``tools/make_tiny_dit.py``) shrink only sizes, so a tiny folder takes
every branch the real checkpoint takes (integer timesteps from ``UniPCMultistepScheduler``, flow
shifts, ``shift_terminal``, two experts, ``expand_timesteps``...). Pure data: no torch, no diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


__all__ = ["PublishedCheckpoint"]
