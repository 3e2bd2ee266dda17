"""LoRA on a transformers module that a :class:`~vllm_omni.stages.model_driver.ModelStageDriver` runs.

The stage's module (Qwen3-Omni's talker: a plain ``nn.Module`` of ``nn.Linear`` layers) gets the
project's own LoRA layers and slot manager, :class:`~vllm_omni.diffusion.lora.DiffusionLoRAManager`
(patched linear layers, the PEFT reader, the host LRU cache with pinning): no second LoRA runtime.
The stage is an LLM stage to the rest of the engine (``AdapterCapabilities("llm", ...)``): one adapter
per request at scale 1.0, identity and versions owned by the adapter registry (the stage is handed
per-version ids and keys its host cache by them).

Adapter keys: as peft saves an adapter trained on the module (``base_model.model.<layer>.lora_A.weight``);
the :class:`ModuleLoRASpec`'s ``prefixes`` are stripped in order (e.g. ``talker.`` for an adapter
trained on the whole Omni model), then every module must name one LoRA-capable layer exactly. Keys
matching a refused fragment (fused MoE experts) are refused with the reason before anything is read.

Stage options: ``enable_lora``, ``max_loras`` (adapters resident at once), ``max_lora_rank``,
``max_cpu_loras`` (host cache) and ``lora_target_modules`` (layer-name suffixes); any other LoRA
option is refused when the stage starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch.nn as nn

from vllm_omni.config.fields import lora_engine_arg_names
from vllm_omni.diffusion.lora.adapter import LoRAAdapterWeights
from vllm_omni.diffusion.lora.loading import load_lora_adapter
from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager
from vllm_omni.diffusion.lora.targets import TargetIndex, bind_adapter
from vllm_omni.diffusion.lora.tensor_adapter import adapter_from_tensors
from vllm_omni.engine.protocols import AdapterCapabilities
from vllm_omni.errors import ConfigError, InvalidAdapterError, LoRAFormatError, StageEngineError, restate
from vllm_omni.lora.adapter_files import listing, locate_adapter, safetensors_keys
from vllm_omni.lora.request import LoRARequest
from vllm_omni.lora.tensor_request import TensorLoRARequest

#: The LoRA stage options a module stage applies (EngineArgs names).
SUPPORTED_OPTIONS = frozenset(
    {"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_target_modules"}
)
#: The key prefix peft's ``save_pretrained`` writes before the module's own names.
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class ModuleLoRASpec:
    """What LoRA binds to on a module stage.

    Attributes:
        module: the module whose ``nn.Linear`` layers get LoRA layers (in place).
        model_name: the module in messages (``"the Qwen3-Omni talker (...)"``).
        prefixes: key prefixes stripped in order after :data:`PEFT_PREFIX` (e.g. ``("talker.",)``:
            an adapter trained on the whole model).
        refused: ``(key fragment, why)``: adapters with a key containing the fragment are refused,
            the message says why (e.g. fused MoE experts that are parameters, not layers).
        hint: appended to the message of an adapter whose keys bind no layer (how its layers are named).
    """

    module: nn.Module
    model_name: str
    prefixes: tuple[str, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()
    hint: str = ""


class ModuleLoRA:
    """Multi-LoRA on one module (:class:`ModuleLoRASpec`), one adapter per request.

    Args:
        spec: the module and its key rules.
        config: the stage's :class:`~vllm_omni.config.lora.OmniStageLoRAConfig` (``max_loras``,
            ``max_lora_rank``, ``max_cpu_loras``, ``target_modules``).
        label: the stage, in messages.
        options: the stage's options (LoRA options other than :data:`SUPPORTED_OPTIONS` are refused).

    Raises:
        StageEngineError: an unsupported LoRA option, or ``lora_target_modules`` selecting no layer
            (the message names the stage and the option).
    """

    def __init__(self, spec: ModuleLoRASpec, config: Any, label: str, options: dict[str, Any]):
        unsupported = sorted((set(options) & lora_engine_arg_names()) - SUPPORTED_OPTIONS)
        if unsupported:
            raise StageEngineError(
                f"{label}: {model_name_of(spec)} applies the LoRA options {sorted(SUPPORTED_OPTIONS)}; "
                f"remove {unsupported}"
            )
        self.spec, self.label = spec, label
        self.max_loras, self.max_rank = int(config.max_loras), int(config.max_lora_rank)
        targets = config.target_modules
        try:
            self.index = TargetIndex({"": spec.module}, None, targets)
            self.manager = DiffusionLoRAManager(
                spec.module,
                max_loras=self.max_loras,
                max_rank=self.max_rank,
                max_cpu_loras=config.max_cpu_loras,
                target_modules=targets,
                denoiser_attrs=(),
                adapter_loader=self._read_path,
            )
        except ConfigError as exc:
            raise StageEngineError(f"{label}: lora_target_modules: {exc}") from exc
        self._names = frozenset(self.index.names())
        #: every LoRA-capable layer, selected by ``lora_target_modules`` or not (for messages)
        self._all_names = (
            self._names if targets is None else frozenset(TargetIndex({"": spec.module}).names())
        )
        self._targets = targets
        #: adapters that passed :meth:`check`, ``{lora_int_id: lora_path}``
        self._valid: dict[int, str] = {}

    def capabilities(self) -> AdapterCapabilities:
        """What the stage reports: an LLM stage's adapters (one per request, at scale 1.0)."""
        return AdapterCapabilities("llm", self.max_loras, 1, self.max_rank)

    def check(self, lora: LoRARequest) -> None:
        """Everything a load would refuse of ``lora``, loading nothing (once per id and path).

        Raises:
            InvalidAdapterError / LoRAFormatError: ``"<stage>: adapter '<name>' (<path>): ..."``:
                missing files, a refused key (named, with the reason), keys that bind no layer of the
                module (named), a rank above ``max_lora_rank``, shapes that do not fit.
        """
        path = str(lora.lora_path)
        if self._valid.get(lora.lora_int_id) == path:
            return
        where = f"{self.label}: adapter {lora.lora_name!r} ({path})"
        try:
            adapter = adapter_from_tensors(lora) if isinstance(lora, TensorLoRARequest) else None
            if adapter is not None:
                self._refuse_keys(list(lora.lora_tensors), adapter.source)
            adapter = adapter or self._read_path(path)
            self._check_names(adapter, isinstance(lora, TensorLoRARequest))
            bind_adapter(adapter, self.index, self.max_rank)
        except FileNotFoundError as exc:
            raise InvalidAdapterError(f"{where}: {exc}") from exc
        except InvalidAdapterError as exc:
            raise restate(exc, where) from exc
        self._valid[lora.lora_int_id] = path

    def add(self, lora: LoRARequest) -> bool:
        """:meth:`check`, then load into the host cache; ``True`` when newly loaded."""
        self.check(lora)
        return self.manager.add_lora(lora)

    def remove(self, lora_int_id: int) -> bool:
        """Drop an adapter (call between requests: an active one raises ``LoRACacheError``)."""
        self._valid.pop(lora_int_id, None)
        return self.manager.remove_lora(lora_int_id)

    def pin(self, lora_int_id: int) -> bool:
        return self.manager.pin_lora(lora_int_id)

    def ids(self) -> set[int]:
        return set(self.manager.list_loras())

    @contextlib.contextmanager
    def applied(self, lora: LoRARequest | None) -> Iterator[None]:
        """``lora`` (loaded if needed) acts on every forward inside the block, at scale 1.0; ``None``:
        the base module. The adapter can be neither evicted nor removed meanwhile."""
        if lora is None:
            yield
            return
        with self.manager.activate([lora], [1.0]):
            yield

    # ------------------------------------------------------------------ reading
    def _read_path(self, path: str) -> LoRAAdapterWeights:
        """The adapter at ``path`` with its module keys renamed to the module's layer names."""
        files = locate_adapter(path)
        self._refuse_keys(safetensors_keys(files.weights), files.weights)  # the header, read (not mapped)
        adapter = load_lora_adapter(path)
        modules = {self._layer_name(k): w for k, w in adapter.modules.items()}
        return replace(adapter, modules=modules)

    def _layer_name(self, key: str) -> str:
        for prefix in (PEFT_PREFIX, *self.spec.prefixes):
            if key.startswith(prefix):
                key = key[len(prefix) :]
        return key

    def _refuse_keys(self, keys: list[str], source: str) -> None:
        for fragment, why in self.spec.refused:
            hits = [k for k in keys if fragment in k]
            if hits:
                raise LoRAFormatError(f"{source}: {listing(hits)} target {why}")

    def _check_names(self, adapter: LoRAAdapterWeights, in_memory: bool) -> None:
        """Every module names a LoRA-capable layer exactly (in-memory adapters: after ``base_model.model.``)."""
        names = [
            k[len(PEFT_PREFIX) :] if in_memory and k.startswith(PEFT_PREFIX) else k for k in adapter.modules
        ]
        unmatched = [k for k in names if k not in self._names]
        outside = [k for k in unmatched if k in self._all_names]
        if outside:
            raise LoRAFormatError(
                f"{adapter.source}: {listing(outside)} are layers of {model_name_of(self.spec)} outside the "
                f"stage's lora_target_modules {self._targets}: add them there, or train without them"
            )
        if unmatched:
            raise LoRAFormatError(
                f"{adapter.source}: {len(unmatched)} of {len(names)} module(s) bind no LoRA layer of "
                f"{model_name_of(self.spec)}: {listing(unmatched)} (key prefixes removed: "
                f"{[PEFT_PREFIX, *self.spec.prefixes]})" + (f"; {self.spec.hint}" if self.spec.hint else "")
            )


def model_name_of(spec: ModuleLoRASpec) -> str:
    return spec.model_name or type(spec.module).__name__


__all__ = ["ModuleLoRA", "ModuleLoRASpec", "PEFT_PREFIX", "SUPPORTED_OPTIONS"]
