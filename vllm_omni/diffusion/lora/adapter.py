"""Format-neutral, host-side representation of a LoRA adapter.

Every on-disk format (the PEFT directory and single ``.safetensors`` files read by
:mod:`.safetensors_format`, and any format added later) is parsed into :class:`LoRAAdapterWeights`:
a mapping from a module name in the denoiser to that module's ``lora_A`` / ``lora_B`` matrices and
its adapter scaling ``s``. Binding to concrete layers (packed slices, tensor-parallel shards) is done
afterwards by :mod:`.targets`, so a new format only has to produce this object.

Math (the project's LoRA terms, after Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models", and Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA"):

    y = W x + s * B (A x),   s = lora_alpha / r        (rsLoRA: s = lora_alpha / sqrt(r))

with ``A`` of shape ``[r, d_in]`` and ``B`` of shape ``[d_out, r]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from vllm_omni.errors import LoRAFormatError

#: Leading key components that name a wrapper rather than a module of the denoiser. They are tried
#: in order when a key does not resolve as written (see :func:`candidate_module_keys`).
DEFAULT_STRIP_PREFIXES: tuple[str, ...] = ("base_model.model.", "transformer.", "diffusion_model.")


def lora_scaling(lora_alpha: float, rank: int, use_rslora: bool = False) -> float:
    """Adapter scaling ``s``: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` for rsLoRA.

    Raises:
        LoRAFormatError: when ``rank`` is not positive or the result is not finite.
    """
    if rank <= 0:
        raise LoRAFormatError(f"LoRA rank must be positive, got {rank}")
    value = float(lora_alpha) / (math.sqrt(rank) if use_rslora else rank)
    if not math.isfinite(value):
        raise LoRAFormatError(f"LoRA scaling is not finite (lora_alpha={lora_alpha}, r={rank})")
    return value


@dataclass
class LoRAModuleWeights:
    """LoRA matrices of one module, on the host.

    Attributes:
        lora_a: ``A``, shape ``[r, d_in]``, float32, CPU.
        lora_b: ``B``, shape ``[d_out, r]``, float32, CPU.
        scaling: ``s`` (already including the rsLoRA / alpha-pattern rules of the source format).
        kind: ``"lora"``, or ``"loha"`` / ``"lokr"`` for a LyCORIS module stored as its exact
            LoRA-equivalent factors (:mod:`.formats.lycoris`), or ``"diff"`` for a full weight delta
            stored as ``A`` with an identity ``B`` (lightx2v ``.diff``); only ``"lora"`` is bound by
            ``max_rank``.
        lora_bias: ``b``, shape ``[d_out]``, float32, CPU, or ``None``: a bias delta read as peft's
            ``lora_B.bias`` (``y = W x + s * (B (A x) + b)``); only Wan ``diff_b`` tensors (converted
            by diffusers) produce one, and only the distill backend applies it
            (:func:`~.targets.bind_adapter`).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    kind: str = "lora"
    lora_bias: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        """The rank ``r`` (rows of ``A``)."""
        return int(self.lora_a.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.lora_a.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.lora_b.shape[0])

    def scaled_b(self) -> torch.Tensor:
        """``s * B`` in float32 (the form the runtime keeps, so the forward needs no extra multiply)."""
        return self.lora_b.float() * self.scaling


@dataclass
class LoRAAdapterWeights:
    """All modules of one adapter, keyed by module name as found in the file (prefixes not yet resolved).

    Attributes:
        modules: module key -> :class:`LoRAModuleWeights`.
        source: file or directory the adapter came from (used in error messages).
        layout: key layout of the source (``"peft"``, ``"diffusers"``, ``"comfyui"``, ``"kohya"``; see
            :mod:`.formats.layouts`). ``"kohya"`` keys are underscore-flattened module paths that are
            resolved against the model's module names when the adapter is bound.
        raw_state_dict: the file's tensors as stored, kept for single files without a configuration
            so that a model family's diffusers key converter can be run on them at bind time
            (:mod:`.formats.model_keys`); ``None`` otherwise.
        has_config: scaling came from a PEFT configuration (directory, sibling ``adapter_config.json``
            or diffusers header metadata) rather than from ``.alpha`` tensors or the ``alpha = r`` default.
        base_model_name_or_path: what the adapter's configuration says it was trained on (informative).
        untargeted: module keys with tensors that the configuration's ``target_modules`` does not
            select (peft would ignore them); refused at bind time once the names are known to resolve.
        text_encoders: the file's text-encoder parts, per pipeline component (``"text_encoder"``,
            ``"text_encoder_2"``, ...; :mod:`.formats.text_encoders`), each parsed like a file of its own
            (module keys relative to that encoder); empty for a denoiser-only adapter.
        deltas: the file's ``diffusion_model.*.diff`` / ``*.diff_b`` keys (lightx2v distill files), set
            aside when read: only a model family converter that reads them (Wan) turns them into
            ``lora_bias`` / LoRA factors at bind time; any other model refuses them, naming these keys.
    """

    modules: dict[str, LoRAModuleWeights] = field(default_factory=dict)
    source: str = "<state dict>"
    layout: str = "peft"
    raw_state_dict: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    has_config: bool = False
    base_model_name_or_path: str | None = None
    untargeted: list[str] = field(default_factory=list)
    text_encoders: dict[str, LoRAAdapterWeights] = field(default_factory=dict, repr=False)
    deltas: list[str] = field(default_factory=list)

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    def nbytes(self) -> int:
        return sum(
            (m.lora_a.numel() + m.lora_b.numel() + (0 if m.lora_bias is None else m.lora_bias.numel())) * 4
            for m in self.modules.values()
        )


def candidate_module_keys(key: str, strip_prefixes: Iterable[str] = DEFAULT_STRIP_PREFIXES) -> list[str]:
    """Names to try, in order, when resolving an adapter's module key against a model.

    The key is tried as written first, then with each known wrapper prefix removed from its start
    (repeatedly, so ``base_model.model.transformer.blocks.0`` also yields ``blocks.0``). Trying the
    literal key first keeps models that really have a child called ``transformer`` working.
    """
    out = [key]
    current = key
    changed = True
    prefixes = tuple(strip_prefixes)
    while changed:
        changed = False
        for prefix in prefixes:
            if current.startswith(prefix) and len(current) > len(prefix):
                current = current[len(prefix) :]
                if current not in out:
                    out.append(current)
                changed = True
                break
    return out
