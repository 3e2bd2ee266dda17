"""Request-time LoRA on a pipeline's text encoder(s): one :class:`~.manager.DiffusionLoRAManager` per encoder.

An adapter file's text-encoder parts (:mod:`.formats.text_encoders`) are applied to the pipeline's
``text_encoder`` / ``text_encoder_2`` / ``text_encoder_3`` (attributes of the pipeline, or of the diffusers
pipeline it wraps), as diffusers' ``load_lora_into_text_encoder`` applies them:
``y = W x + lambda_te * s * B (A x)`` on the encoder's ``nn.Linear`` layers, with ``lambda_te`` the
adapter's ``text_encoder_scale`` (default: its scale).

:class:`TextEncoderLoRA` owns those managers. Its :meth:`TextEncoderLoRA.read` is the denoiser managers'
``adapter_loader``: it reads the file once, refuses parts for encoders the pipeline lacks (naming their
keys, before anything is cached), hands the denoiser part to the denoiser manager and keeps the text-encoder
parts for the encoder managers' loaders, which would otherwise read the file again. A batch of prompts
``[B, L, D]`` through an encoder gets per-prompt adapters and scales: the LoRA layers treat the leading
dimension of a layer input as the sample (:meth:`TextEncoderLoRA.activate`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import partial

import torch.nn as nn

from vllm_omni.diffusion.lora.adapter import LoRAAdapterWeights
from vllm_omni.diffusion.lora.formats.text_encoders import (
    TEXT_ENCODER_COMPONENTS,
    fit_part_to_encoder,
    text_encoder_parts_refusal,
)
from vllm_omni.diffusion.lora.loading import load_lora_adapter
from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager
from vllm_omni.errors import LoRAFormatError
from vllm_omni.lora.request import LoRARequest, RequestAdapters


def find_text_encoders(pipeline: object) -> dict[str, nn.Module]:
    """``{component: module}`` of the pipeline's text encoders, in :data:`TEXT_ENCODER_COMPONENTS` order:
    the pipeline's own attributes, else those of the diffusers pipeline it wraps (``pipeline.pipe``)."""
    found = {}
    for holder in (pipeline, getattr(pipeline, "pipe", None)):
        for name in TEXT_ENCODER_COMPONENTS:
            module = getattr(holder, name, None)
            if isinstance(module, nn.Module) and name not in found:
                found[name] = module
    return found


class TextEncoderLoRA:
    """The LoRA managers of a pipeline's text encoders and the split of adapter files between them.

    Args:
        pipeline: the loaded pipeline (see :func:`find_text_encoders`).
        label: how messages name the stage.
        sizes: ``max_loras``, ``max_rank``, ``max_cpu_loras`` of the stage (the managers' sizes).

    Attributes:
        managers: component -> its :class:`DiffusionLoRAManager` (every ``nn.Linear`` of the encoder
            wrapped; nothing applies until :meth:`activate`).
        components: adapter id -> the text encoders its file has parts for (recorded when it is read).
    """

    def __init__(self, pipeline: object, label: str, **sizes) -> None:
        self.label = label
        self.encoders = find_text_encoders(pipeline)
        self.managers = {
            name: DiffusionLoRAManager(
                types.SimpleNamespace(**{name: module}),
                denoiser_attrs=(name,),
                adapter_loader=partial(self._load_part, name),
                **sizes,
            )
            for name, module in self.encoders.items()
        }
        self.components: dict[int, tuple[str, ...]] = {}
        self._parts: dict[str, dict[str, LoRAAdapterWeights]] = {}

    def read(self, path: str) -> LoRAAdapterWeights:
        """The denoiser managers' ``adapter_loader``: the file's denoiser part; its text-encoder parts are
        kept for :meth:`note_loaded`.

        Raises:
            LoRAFormatError: parts for text encoders this pipeline lacks (their keys named); see
                :func:`.loading.load_lora_adapter`.
        """
        adapter = load_lora_adapter(path)
        if not adapter.text_encoders:
            return adapter
        missing = [c for c in adapter.text_encoders if c not in self.encoders]
        if missing:
            why = f"{self.label} has text encoders {list(self.encoders)}"
            raise LoRAFormatError(text_encoder_parts_refusal(adapter, why, missing))
        self._parts[path] = adapter.text_encoders
        return replace(adapter, text_encoders={})

    def note_loaded(self, loras: Sequence[LoRARequest]) -> None:
        """Record which text encoders each of ``loras`` has parts for (after the denoiser managers read
        them); adapters read earlier keep their record, others (tensor adapters) have none."""
        for lora in loras:
            if lora.lora_int_id not in self.components:
                parts = self._parts.get(lora.lora_path) or {}
                self.components[lora.lora_int_id] = tuple(parts)

    def done_loading(self) -> None:
        """Drop the text-encoder parts kept since the last :meth:`read` (the encoder managers have them)."""
        self._parts.clear()

    def _load_part(self, name: str, path: str) -> LoRAAdapterWeights:
        parts = self._parts.get(path)
        if parts is None or name not in parts:
            parts = load_lora_adapter(path).text_encoders
        if name not in parts:
            raise LoRAFormatError(f"{path}: no {name} part (the file changed since it was read)")
        part = parts[name]
        return replace(
            part, modules=fit_part_to_encoder(part.modules, self.encoders[name]), raw_state_dict=None
        )

    def users(self, lora: LoRARequest) -> list[str]:
        """The text encoders ``lora`` acts on."""
        return [c for c in self.components.get(lora.lora_int_id, ()) if c in self.managers]

    @contextlib.contextmanager
    def activate(self, prompts: Sequence[RequestAdapters], rows: list[int] | None) -> Iterator[None]:
        """A context activating, on every text encoder, each encoded sequence's adapters.

        Args:
            prompts: per prompt its adapters, each ``scale`` the one its text-encoder parts apply at.
            rows: the prompt index of each sequence of the encoder batch (leading dimension of the
                encoder's layer inputs, negative prompts included), or ``None``: one set for every row
                (all ``prompts`` must then share it; the caller checks).
        """
        with contextlib.ExitStack() as stack:
            for name, manager in self.managers.items():
                chosen = [RequestAdapters(tuple(a for a in p if name in self.users(a.lora))) for p in prompts]
                if not any(chosen):
                    continue
                stack.enter_context(
                    manager.activate_adapters(chosen[0] if rows is None else [chosen[r] for r in rows])
                )
            yield
