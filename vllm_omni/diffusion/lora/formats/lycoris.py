"""LyCORIS LoHa and LoKr adapters, turned into exact LoRA-equivalent factors ``(A, B)``.

Sources: peft ``LoHaConfig`` / ``LoKrConfig`` directories (``adapter_config.json`` with ``peft_type``
``LOHA`` / ``LOKR``; keys ``base_model.model.<module>.hada_w1_a`` ...) and LyCORIS / kohya single files
(``lora_unet_<flat module>.hada_w1_a`` ..., per-module ``.alpha``). Per module, with ``s`` the scaling:

* LoHa (Hadamard product):  ``dW = s * (w1_a @ w1_b) * (w2_a @ w2_b)``, ``w1_a [out, r1]``, ``w1_b [r1, in]``;
* LoKr (Kronecker product): ``dW = s * kron(w1, w2)``, ``w1 [p, q]``, ``w2 [m, n]``, ``out = p m``, ``in = q n``,
  each of ``w1`` / ``w2`` stored whole (``lokr_w1``) or as a product (``lokr_w1_a @ lokr_w1_b``).

Both are low-rank products of their factors, so the runtime serves them as plain LoRA pairs (slots,
composition with LoRA, mixed batches, tensor-parallel cuts and the distill fuse all unchanged):

* LoHa: ``B[:, i r2 + j] = w1_a[:, i] * w2_a[:, j]``, ``A[i r2 + j, :] = w1_b[i, :] * w2_b[j, :]`` (rank ``r1 r2``);
* LoKr: with ``w1 = U1 V1`` and ``w2 = U2 V2`` (a whole factor is ``I @ w`` or ``w @ I``, whichever is
  narrower), ``kron(w1, w2) = kron(U1, U2) kron(V1, V2)`` (rank ``k1 k2``).

When that rank ``R`` costs more than the dense update (``R (in + out) > in out + min(in, out)^2``), the
module is stored densely as ``(A, B) = (I, dW)`` or ``(dW, I)`` instead. Equivalent ranks are not bound by
``max_rank`` (it limits LoRA files). Scaling: peft's ``alpha / r`` (``rank_pattern`` / ``alpha_pattern``
applied); in files, LyCORIS' ``alpha / dim`` with ``dim`` the inner size of the factorised ``w1_b`` (LoHa)
or of ``w2_b`` (else ``w1_b``) for LoKr, and ``s = 1`` without ``.alpha`` or without any factorised LoKr
factor. Refused (naming the file, the module and the key): Tucker factors (``hada_t1``, ``hada_t2``,
``lokr_t1``, ``lokr_t2``: convolution cores, and every layer served here is linear), weight-decomposed
variants (``dora_scale``, ``use_effective_conv2d``), any other per-module key, incomplete or
mismatched factors.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import peft
import torch
from peft.utils.other import get_pattern_key

from vllm_omni.diffusion.lora.adapter import LoRAModuleWeights, candidate_module_keys
from vllm_omni.errors import LoRAFormatError
from vllm_omni.lora.adapter_files import _as_float32, check_dtypes

LOHA_KEYS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR_KEYS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
TUCKER_KEYS = ("hada_t1", "hada_t2", "lokr_t1", "lokr_t2")
_KEY = re.compile(r"^(?P<module>.+?)\.(?P<name>hada_[a-z0-9_]+|lokr_[a-z0-9_]+)(?:\.weight)?$")
_PEFT_TYPES = {"LOHA": "LoHaConfig", "LOKR": "LoKrConfig"}


def lycoris_modules(state_dict: Mapping[str, torch.Tensor]) -> set[str]:
    """Module keys that carry at least one ``hada_*`` / ``lokr_*`` tensor."""
    return {m["module"] for m in map(_KEY.match, state_dict) if m}


def split_lycoris(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(lycoris part, rest)``: every key of a LoHa / LoKr module (its ``.alpha`` and ``dora_scale``
    included) goes to the first part, everything else (plain LoRA modules) to the second."""
    modules = lycoris_modules(state_dict)
    ours: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        module = key.rsplit(".", 1)[0]
        hit = _KEY.match(key)
        (ours if (hit or module in modules) else rest)[key] = tensor
    return ours, rest


# ----------------------------------------------------------------------------- configuration
def lycoris_config_from_dict(raw: Mapping[str, Any], source: str) -> Any | None:
    """peft's ``LoHaConfig`` / ``LoKrConfig`` for a LOHA / LOKR ``adapter_config.json``, else ``None``.

    Raises:
        LoRAFormatError: no ``alpha``, a non-integer ``r``, ``use_effective_conv2d`` (Tucker convolution
            cores), ``modules_to_save``, or a field peft refuses.
    """
    kind = str(raw.get("peft_type") or "").upper()
    if kind not in _PEFT_TYPES:
        return None

    cls = getattr(peft, _PEFT_TYPES[kind])
    if raw.get("alpha") is None:
        raise LoRAFormatError(f"{source}: {kind} config has no alpha, so the scaling alpha / r is unknown")
    if isinstance(raw.get("r"), bool) or not isinstance(raw.get("r", 8), int):
        raise LoRAFormatError(f"{source}: {kind} config 'r' must be an integer, got {raw.get('r')!r}")
    for name, why in (
        ("use_effective_conv2d", "Tucker convolution cores; the layers served here are linear"),
        ("modules_to_save", "whole replacement modules cannot be swapped per request"),
    ):
        if raw.get(name):
            raise LoRAFormatError(f"{source}: {kind} config {name}={raw[name]!r} is not supported ({why})")
    known = set(cls.__dataclass_fields__)
    kwargs = {k: v for k, v in raw.items() if k in known and k not in ("peft_type", "task_type")}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise LoRAFormatError(f"{source}: invalid {kind} config: {exc}") from exc


def read_lycoris_config(config_file: str, source: str) -> Any | None:
    """The LoHa / LoKr config in ``config_file`` (an ``adapter_config.json``), or ``None`` for another type.

    Raises:
        LoRAFormatError: unreadable JSON, or see :func:`lycoris_config_from_dict`.
    """
    try:
        with open(config_file) as handle:
            raw = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAFormatError(f"{source}: adapter_config.json is not readable JSON: {exc}") from exc
    return lycoris_config_from_dict(raw, source) if isinstance(raw, dict) else None


def _declared(config: Any, module_key: str) -> tuple[int, float]:
    rank, alpha = config.r, config.alpha
    if config.rank_pattern:
        rank = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module_key), rank)
    if config.alpha_pattern:
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module_key), alpha)
    return int(rank), float(alpha)


# ----------------------------------------------------------------------------- factors
def _as_product(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w = U @ V`` with the narrower identity factor (inner size ``min(w.shape)``)."""
    p, q = w.shape
    return (torch.eye(p), w) if p <= q else (w, torch.eye(q))


def loha_factors(w1a: torch.Tensor, w1b: torch.Tensor, w2a: torch.Tensor, w2b: torch.Tensor):
    """``(A [r1 r2, in], B [out, r1 r2])`` with ``B @ A == (w1a @ w1b) * (w2a @ w2b)``."""
    b = (w1a[:, :, None] * w2a[:, None, :]).reshape(w1a.shape[0], -1)
    a = (w1b[:, None, :] * w2b[None, :, :]).reshape(-1, w1b.shape[1])
    return a, b


def lokr_factors(w1: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor]):
    """``(A, B)`` with ``B @ A == kron(U1 @ V1, U2 @ V2)`` for ``w1 = (U1, V1)``, ``w2 = (U2, V2)``."""
    return torch.kron(w1[1], w2[1]), torch.kron(w1[0], w2[0])


def cheapest_form(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` as given, or the dense update with an identity factor when that holds fewer numbers."""
    rank, d_in, d_out = a.shape[0], a.shape[1], b.shape[0]
    if rank * (d_in + d_out) <= d_in * d_out + min(d_in, d_out) ** 2:
        return a, b
    return dense_form(a, b)


def dense_form(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense update ``dW = B @ A`` (computed in float64) with an identity on its narrower side:
    ``(I [in, in], dW)`` or ``(dW, I [out, out])``, float32."""
    d_in, d_out = a.shape[1], b.shape[0]
    delta = (b.double() @ a.double()).float()
    return (torch.eye(d_in), delta) if d_in <= d_out else (delta, torch.eye(d_out))


# ----------------------------------------------------------------------------- parsing
def _refuse(source: str, module: str, key: str, why: str) -> LoRAFormatError:
    return LoRAFormatError(f"{source}: module {module!r}: key {key!r} is not supported ({why})")


def _module_tensors(state_dict: Mapping[str, torch.Tensor], source: str):
    groups: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, float] = {}
    modules = lycoris_modules(state_dict)
    for key, tensor in state_dict.items():
        hit = _KEY.match(key)
        if hit:
            name, module = hit["name"], hit["module"]
            if name in TUCKER_KEYS:
                raise _refuse(
                    source, module, key, "Tucker factors are convolution cores; this layer is linear"
                )
            if name not in LOHA_KEYS + LOKR_KEYS:
                raise _refuse(source, module, key, "not a LoHa / LoKr factor this runtime applies")
            groups.setdefault(module, {})[name] = _as_float32(tensor, key, source)
            continue
        module, _, name = key.rpartition(".")
        if name == "alpha" and module in modules and tensor.numel() == 1:
            alphas[module] = float(tensor.reshape(()).float().item())
        elif name in ("dora_scale", "scalar") or key.endswith((".dora_scale", ".scalar")):
            raise _refuse(source, module, key, "weight-decomposed / rescaled LyCORIS variant (DoRA-like)")
        else:
            raise _refuse(source, module, key, "not a LoHa / LoKr factor this runtime applies")
    return groups, alphas


def _pair(parts: dict[str, torch.Tensor], name: str, key: str, source: str, module: str):
    whole, a, b = parts.get(name), parts.get(name + "_a"), parts.get(name + "_b")
    if whole is not None and a is None and b is None and whole.dim() == 2:
        return _as_product(whole), None
    if whole is None and a is not None and b is not None and a.dim() == 2 and b.dim() == 2:
        if a.shape[1] != b.shape[0]:
            raise LoRAFormatError(
                f"{source}: module {module!r}: {name}_a {tuple(a.shape)} and {name}_b {tuple(b.shape)} do not multiply"
            )
        return (a, b), int(b.shape[0])
    raise LoRAFormatError(
        f"{source}: module {module!r} ({key}): needs 2-D {name} or both {name}_a and {name}_b, got {sorted(parts)}"
    )


def _factors(module: str, parts: dict[str, torch.Tensor], source: str):
    """``(kind, A, B, dim)`` of one module; ``dim`` is the inner size alpha divides (``None``: none)."""
    has_loha, has_lokr = any(k in LOHA_KEYS for k in parts), any(k in LOKR_KEYS for k in parts)
    if has_loha and has_lokr:
        raise LoRAFormatError(f"{source}: module {module!r} mixes LoHa and LoKr keys: {sorted(parts)}")
    if has_loha:
        missing = [k for k in LOHA_KEYS if k not in parts]
        if missing:
            raise LoRAFormatError(f"{source}: LoHa module {module!r} lacks {missing}")
        w1a, w1b, w2a, w2b = (parts[k] for k in LOHA_KEYS)
        ok = all(t.dim() == 2 for t in (w1a, w1b, w2a, w2b))
        ok = ok and w1a.shape[1] == w1b.shape[0] and w2a.shape[1] == w2b.shape[0]
        ok = ok and w1a.shape[0] == w2a.shape[0] and w1b.shape[1] == w2b.shape[1]
        if not ok:
            shapes = {k: tuple(parts[k].shape) for k in LOHA_KEYS}
            raise LoRAFormatError(f"{source}: LoHa module {module!r} has mismatched shapes {shapes}")
        a, b = loha_factors(w1a, w1b, w2a, w2b)
        return "loha", a, b, int(w1b.shape[0])
    w1, dim1 = _pair(parts, "lokr_w1", "LoKr w1", source, module)
    w2, dim2 = _pair(parts, "lokr_w2", "LoKr w2", source, module)
    a, b = lokr_factors(w1, w2)
    return "lokr", a, b, (dim2 if dim2 is not None else dim1)


def lycoris_module_weights(
    state_dict: Mapping[str, torch.Tensor], *, config: Any | None, source: str
) -> dict[str, LoRAModuleWeights]:
    """LoHa / LoKr modules of ``state_dict`` as LoRA-equivalent :class:`LoRAModuleWeights`.

    Args:
        state_dict: the LyCORIS part of a file (see :func:`split_lycoris`).
        config: the peft ``LoHaConfig`` / ``LoKrConfig`` shipped with it, or ``None``.
        source: file name for messages.

    Returns:
        module key -> weights: ``A [R, in]``, ``B [d_out, R]`` float32 with ``B @ A`` the module's
        unscaled update, ``scaling`` ``s`` and ``kind`` ``"loha"`` / ``"lokr"``.

    Raises:
        LoRAFormatError: see the module docstring; also a config rank that disagrees with the stored
            factors, an alpha of 0 or not finite, or a config of another PEFT type.
    """
    if config is not None and type(config).__name__ not in _PEFT_TYPES.values():
        raise LoRAFormatError(f"{source}: LoHa / LoKr tensors with a {type(config).__name__}")
    check_dtypes(state_dict, source)
    groups, alphas = _module_tensors(state_dict, source)
    modules: dict[str, LoRAModuleWeights] = {}
    for module, parts in groups.items():
        kind, a, b, dim = _factors(module, parts, source)
        if config is not None:
            declared, alpha = _declared(config, candidate_module_keys(module)[-1])
            stored = {int(t.shape[0]) for k, t in parts.items() if k.endswith("_b")}
            if kind == "loha" and stored != {declared} or kind == "lokr" and stored - {declared}:
                raise LoRAFormatError(
                    f"{source}: module {module!r} stores rank(s) {sorted(stored)} but the config declares r={declared}"
                )
            scaling = alpha / declared
        else:
            alpha = alphas.get(module)
            scaling = 1.0 if alpha is None or dim is None else alpha / dim
        if not math.isfinite(scaling) or scaling == 0.0:
            raise LoRAFormatError(f"{source}: module {module!r} has scaling {scaling!r} (alpha {alpha!r})")
        a, b = cheapest_form(a, b)
        modules[module] = LoRAModuleWeights(a.contiguous(), b.contiguous(), float(scaling), kind=kind)
    return modules
