"""Weight loading helpers shared by the in-tree diffusion denoisers.

Checkpoints are diffusers-format component folders (``transformer/``) holding
``*.safetensors`` files, optionally sharded with a ``*.safetensors.index.json``.
Names in the checkpoint are diffusers module paths; a model maps the separate
projections it packs (``to_q``/``to_k``/``to_v`` -> ``to_qkv``) through its
``stacked_params_mapping`` and every parameter's ``weight_loader`` slices out this
rank's tensor-parallel shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from vllm_omni.diffusion.distributed.parallel_state import current_vllm_config_for_layers
from vllm_omni.errors import ConfigError

StackedParamsMapping = list[tuple[str, str, str | int]]


def safetensors_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a component folder, in load order.

    Uses the shard list of a ``*.safetensors.index.json`` when one exists, else every
    ``*.safetensors`` file sorted by name.

    Raises:
        FileNotFoundError: when the folder holds no safetensors weights.
    """
    folder = Path(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"safetensors index in {folder} lists missing shards: {missing}")
    return files


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of a component folder (CPU tensors, stored dtype)."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _swap_segment(name: str, old: str, new: str) -> str | None:
    """Replace the dotted path segment ``old`` by ``new``; ``None`` when ``old`` is no segment of ``name``.
    A mapping written vLLM's way (``".to_q"``) names the same segment as the bare form (``"to_q"``)."""
    old, new = old.strip("."), new.strip(".")
    parts = name.split(".")
    if old not in parts:
        return None
    parts[parts.index(old)] = new
    return ".".join(parts)


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: StackedParamsMapping,
    strict: bool = True,
) -> set[str]:
    """Copy checkpoint tensors into ``model`` through packed-parameter weight loaders.

    Args:
        model: the module to fill; its parameters may carry a ``weight_loader``
            attribute (vLLM layers) taking ``(param, tensor[, shard_id])``.
        weights: ``(checkpoint_name, tensor)`` pairs; names follow diffusers module paths.
        stacked_params_mapping: ``(packed_name, sub_name, shard_id)`` entries; a
            checkpoint tensor whose path has segment ``sub_name`` is loaded into the
            parameter with ``packed_name`` in its place, as shard ``shard_id``.
        strict: raise on checkpoint tensors without a parameter and on parameters
            that received no tensor.

    Returns:
        The model parameter names that were (at least partly) loaded.

    Raises:
        ValueError: in strict mode, listing unexpected and missing names.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        target = None
        for packed, sub, shard_id in stacked_params_mapping:
            packed_name = _swap_segment(name, sub, packed)
            if packed_name is not None and packed_name in params:
                target = (packed_name, shard_id)
                break
        if target is not None:
            param = params[target[0]]
            param.weight_loader(param, tensor.to(param.dtype), target[1])
            loaded.add(target[0])
            continue
        if name not in params:
            unexpected.append(name)
            continue
        param = params[name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor.to(param.dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if strict and (unexpected or missing):
        raise ConfigError(
            f"checkpoint does not match {type(model).__name__}: unexpected tensors {sorted(unexpected)[:20]}, "
            f"parameters without weights {missing[:20]}"
        )
    return loaded


def finalize_linear_layers(model: nn.Module, keep_base_weights: bool = True) -> None:
    """Run each vLLM linear layer's ``process_weights_after_loading`` once weights are in.

    On CPU vLLM normally repacks the weight for oneDNN / SGL kernels and replaces
    ``layer.weight`` by an empty tensor (the packed copy then lives only inside the
    layer's ``cpu_linear`` closure). With ``keep_base_weights=True`` (default) the layer
    is marked ``_cpu_skip_gemm_dispatch`` instead: ``layer.weight`` keeps the dense
    ``[out_features_per_rank, in_features_per_rank]`` base weight and the forward uses
    ``torch.nn.functional.linear``, so later code (LoRA merging) can read or modify it.
    On CUDA the unquantized method leaves ``layer.weight`` in place either way.
    """
    for module in model.modules():
        if isinstance(module, LinearBase):
            if keep_base_weights:
                module._cpu_skip_gemm_dispatch = True
            module.quant_method.process_weights_after_loading(module)


def read_component_config(folder: str | Path) -> dict:
    """A diffusers component's ``config.json`` without its private ``_``-keys (``_class_name``, ...).

    Raises:
        FileNotFoundError: the folder has no ``config.json``.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def load_denoiser(
    cls: type[nn.Module],
    folder: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    keep_base_weights: bool = True,
) -> nn.Module:
    """Build ``cls(**config.json, dtype=dtype)`` from a diffusers ``transformer/`` folder and load it.

    The model is constructed under the diffusion worker's vLLM config on ``device``, filled by its
    ``load_weights(iter_safetensors(folder))`` (strict), its vLLM linear layers finalised
    (:func:`finalize_linear_layers`), and returned in eval mode without gradients.
    Requires an initialised diffusion parallel state.

    Raises:
        FileNotFoundError: missing config or weights. ConfigError: checkpoint/config mismatch.
    """
    config = read_component_config(folder)
    with current_vllm_config_for_layers(), torch.device(device):
        model = cls(**config, dtype=dtype)
    model.load_weights(iter_safetensors(folder))
    finalize_linear_layers(model, keep_base_weights=keep_base_weights)
    return model.eval().requires_grad_(False)


class PretrainedDenoiser(nn.Module):
    """Base of the in-tree denoisers: loading from a diffusers ``transformer/`` folder.

    A subclass declares :attr:`stacked_params_mapping` (``(packed_param, checkpoint_sub_module,
    shard_id)``: which checkpoint projections share one packed vLLM layer; also read by the LoRA
    manager) and takes the ``config.json`` fields plus ``dtype`` in its constructor.
    """

    stacked_params_mapping: StackedParamsMapping = []

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        keep_base_weights: bool = True,
    ):
        """Build from the folder and load this rank's shard (see :func:`load_denoiser`).

        Raises:
            FileNotFoundError: missing config or weights. ConfigError: checkpoint/config mismatch.
        """
        return load_denoiser(cls, folder, dtype, device, keep_base_weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load diffusers-named tensors through :attr:`stacked_params_mapping`; strict (see
        :func:`load_stacked_weights`)."""
        return load_stacked_weights(self, weights, self.stacked_params_mapping)
