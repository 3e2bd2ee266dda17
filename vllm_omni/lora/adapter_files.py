"""Adapter files: the one place that locates, reads and checks a LoRA adapter on disk.

Used by every gate: the LLM stage (:mod:`vllm_omni.engine.lora_validation`), the diffusion
readers (:mod:`vllm_omni.diffusion.lora.peft_format` / ``safetensors_format``) and the HTTP
adapter registry (:mod:`vllm_omni.entrypoints.openai.lora`).

* :func:`locate_adapter`: a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``),
  one ``.safetensors`` file, or a folder holding exactly one of them and no config; pickle formats
  (:data:`PICKLE_SUFFIXES`) are refused, since
  loading them can run arbitrary code. Nothing is read.
* :func:`read_adapter_config` / :func:`lora_config_from_dict`: the configuration as peft's own
  ``LoraConfig``, refusing what would silently change the math (no ``lora_alpha``, a non-integer
  ``r``, a non-finite alpha) and features this runtime does not implement (:func:`check_lora_config`).
* :func:`read_safetensors`: tensors and header metadata, with safetensors only, from the file's bytes
  read into memory (never mapped: trainers rewrite adapter files in place).
* :func:`pair_lora_tensors`: ``lora_A`` / ``lora_B`` grouped per module, floating-point and finite.
* :func:`update_range_problem`: whether one module's update ``s * B @ A`` stays representable in the
  dtype a stage computes in (each gate calls it with its own compute dtype).
* :func:`file_signature` / :func:`fingerprint_files`: an adapter's ``(inode, size, mtime)`` and the SHA-256
  of its bytes (its version, for :mod:`vllm_omni.lora.registry`).
* :func:`declared_rank_alpha`: a module's ``r`` / ``lora_alpha`` after ``rank_pattern`` /
  ``alpha_pattern``, matched with peft's ``get_pattern_key``.

Every refusal is a :class:`~vllm_omni.errors.LoRAFormatError` (an ``InvalidAdapterError``) whose
message starts with the file or adapter it is about and names the offending module or key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import safetensors.torch
import torch
from peft import LoraConfig
from peft.utils.other import get_pattern_key

from vllm_omni.errors import LoRAFormatError

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
SAFETENSORS_SUFFIX = ".safetensors"
#: File suffixes of pickle-based checkpoints (torch.save / pickle): refused everywhere.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: dtypes an adapter tensor may have; anything else (int8/uint8/fp8/bool ...) is a quantised or
#: otherwise packed tensor that cannot be used without its dequantisation recipe.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# "<module>.lora_A.weight" or "<module>.lora_A.<adapter name>.weight"
LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")
_ALPHA_KEY = re.compile(r"^(?P<module>.+)\.alpha$")
_SHOWN = 12
_HASH_CHUNK = 1 << 20

# Config fields whose non-default value changes the math in ways this runtime does not implement.
_UNSUPPORTED_FIELDS: tuple[tuple[str, str], ...] = (
    ("use_dora", "DoRA (weight-decomposed LoRA) needs magnitude vectors and a norm per forward"),
    ("modules_to_save", "modules_to_save replaces whole modules, which request-time LoRA cannot swap"),
    ("lora_bias", "LoRA bias terms are not supported"),
    ("trainable_token_indices", "trainable token embeddings are not supported"),
    ("layer_replication", "layer replication is not supported"),
    (
        "target_parameters",
        "LoRA on raw parameters (target_parameters) is not supported; peft targets MoE experts so "
        "(e.g. for gate_proj/up_proj/down_proj on Qwen3-Omni), and vllm_omni keeps MoE experts out of "
        "LoRA because vLLM's fused-MoE LoRA layer runs on Triton kernels only",
    ),
    ("use_qalora", "QA-LoRA is not supported"),
    ("use_bdlora", "block-diagonal LoRA is not supported"),
    ("alora_invocation_tokens", "activated LoRA (aLoRA) is not supported"),
)


def listing(keys: Any) -> str:
    """Up to 12 sorted keys, quoted, with a count of the rest (for error messages)."""
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" (+{len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else "")


# ---------------------------------------------------------------------------- location
@dataclass(frozen=True)
class AdapterFiles:
    """Where an adapter's files are.

    Attributes:
        weights: the ``.safetensors`` file.
        config: the ``adapter_config.json`` beside it, or ``None``.
        is_directory: the adapter was given as a directory (a PEFT directory, or a folder holding one
            single-file adapter: then ``config`` is ``None``).
    """

    weights: str
    config: str | None
    is_directory: bool


def locate_adapter(path: str | os.PathLike[str], *, shown: str | None = None, directory_only: bool = False):
    """Find an adapter's files without reading them.

    Args:
        path: a PEFT directory, a single ``.safetensors`` file, or a directory holding exactly one
            ``.safetensors`` file and no ``adapter_config.json`` (that file is the adapter; not with
            ``directory_only``).
        shown: how to name the adapter in messages (default: ``path`` as given).
        directory_only: accept only a PEFT directory (vLLM's LLM LoRA loads directories).

    Returns:
        :class:`AdapterFiles`.

    Raises:
        FileNotFoundError: ``path`` does not exist (not with ``directory_only``).
        LoRAFormatError: a pickle file, a file that is not ``.safetensors``, a directory without
            ``adapter_config.json`` or ``adapter_model.safetensors`` (pickle files found are named),
            an adapter file that is not a regular file (a FIFO would block the reader), or
            (``directory_only``) anything but a directory.
    """
    path = os.fspath(path)
    shown = path if shown is None else shown
    if directory_only and not os.path.isdir(path):
        raise LoRAFormatError(f"{shown}: not a directory (expected a PEFT adapter folder)")
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        raise LoRAFormatError(f"{shown}: not a regular file (a FIFO, socket or device is never opened)")
    if os.path.isfile(path):
        if path.endswith(SAFETENSORS_SUFFIX):
            config = os.path.join(os.path.dirname(os.path.abspath(path)), ADAPTER_CONFIG_NAME)
            if os.path.exists(config) and not os.path.isfile(config):
                raise LoRAFormatError(f"{shown}: {ADAPTER_CONFIG_NAME} beside it is not a regular file")
            return AdapterFiles(path, config if os.path.isfile(config) else None, False)
        kind = (
            "a pickle file, which is refused (loading it can run code)"
            if path.endswith(PICKLE_SUFFIXES)
            else ("not a .safetensors file")
        )
        raise LoRAFormatError(f"{shown}: {kind}; only safetensors adapters are served")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"LoRA adapter not found: {shown!r}")
    try:
        files = set(os.listdir(path))
    except OSError:
        raise LoRAFormatError(f"{shown}: the directory is not readable") from None
    singles = sorted(f for f in files if f.endswith(SAFETENSORS_SUFFIX))
    if ADAPTER_CONFIG_NAME not in files and len(singles) == 1 and not directory_only:
        # a folder holding one single-file adapter (diffusers' save_lora_weights, a download of one
        # file): that file, as if passed by its own path (it has no adapter_config.json beside it)
        weights = os.path.join(path, singles[0])
        if not os.path.isfile(weights):
            raise LoRAFormatError(
                f"{shown}: {singles[0]} is not a regular file (a FIFO, socket or device is never opened)"
            )
        return AdapterFiles(weights, None, True)
    if ADAPTER_WEIGHTS_NAME not in files or ADAPTER_CONFIG_NAME not in files:
        raise LoRAFormatError(_not_a_peft_folder(path, shown, files, directory_only))
    weights, config = os.path.join(path, ADAPTER_WEIGHTS_NAME), os.path.join(path, ADAPTER_CONFIG_NAME)
    for name, file in ((ADAPTER_WEIGHTS_NAME, weights), (ADAPTER_CONFIG_NAME, config)):
        # readers such as safetensors' safe_open hold the GIL while they open a file: a FIFO
        # here would freeze the whole process, so nothing but a regular file is opened
        if not os.path.isfile(file):
            raise LoRAFormatError(
                f"{shown}: {name} is not a regular file (a FIFO, socket or device is never opened)"
            )
    return AdapterFiles(weights, config, True)


def file_signature(files: AdapterFiles) -> tuple:
    """``((path, inode, size, mtime_ns), ...)`` of the config (when present) and weights files.

    Raises:
        OSError: a file is gone.
    """
    out = []
    for path in (files.config, files.weights):
        if path is not None:
            st = os.stat(path)
            out.append((path, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def fingerprint_files(files: AdapterFiles) -> str:
    """SHA-256 (hex) of ``b"config\\0" + config bytes`` (empty without a config) ``+ b"weights\\0" +
    weights bytes``, read in 1 MiB chunks (the bytes are hashed, not parsed)."""
    digest = hashlib.sha256()
    for label, path in (("config", files.config), ("weights", files.weights)):
        digest.update(label.encode() + b"\0")
        if path is None:
            continue
        with open(path, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _not_a_peft_folder(path: str, shown: str, files: set[str], directory_only: bool) -> str:
    """The message for a directory that is not a PEFT adapter folder: what is missing, what such a
    folder holds, and, when it holds single ``.safetensors`` files, how to pass one of them."""
    missing = [n for n in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME) if n not in files]
    message = (
        f"{shown}: missing {' and '.join(missing)}; a PEFT adapter folder holds {ADAPTER_CONFIG_NAME} "
        f"(peft's LoraConfig with r and lora_alpha) and {ADAPTER_WEIGHTS_NAME} (peft's save_pretrained)"
    )
    pickled = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
    if pickled:
        message += f"; pickle files {pickled} are refused (convert them to safetensors)"
    singles = sorted(f for f in files if f.endswith(SAFETENSORS_SUFFIX) and f != ADAPTER_WEIGHTS_NAME)
    if not singles:
        return message
    named = ", ".join(repr(os.path.join(path, f)) for f in singles[:_SHOWN])
    if directory_only:
        return (
            f"{message}; it holds the single-file adapter(s) {named}, which this stage (vLLM) cannot load: "
            f"save the adapter with peft's save_pretrained, or write the {ADAPTER_CONFIG_NAME} it was "
            f"trained with beside the file renamed to {ADAPTER_WEIGHTS_NAME}"
        )
    return f"{message}; it holds the single-file adapter(s) {named}: pass one by its own path instead"


# ---------------------------------------------------------------------------- configuration
def check_lora_config(config: Any, source: str) -> None:
    """Reject PEFT configurations whose features this runtime does not implement.

    Raises:
        LoRAFormatError: non-LoRA PEFT type, ``bias`` other than ``"none"``, or a set DoRA /
            ``modules_to_save`` / LoRA-bias / trainable-token / ... field (named).
    """
    peft_type = getattr(config, "peft_type", None)
    peft_type_name = getattr(peft_type, "value", peft_type)
    if str(peft_type_name).upper() != "LORA":
        raise LoRAFormatError(f"{source}: PEFT type {peft_type_name!r} is not LoRA")
    for name, why in _UNSUPPORTED_FIELDS:
        value = getattr(config, name, None)
        if value:
            raise LoRAFormatError(f"{source}: {name}={value!r} is not supported: {why}")
    bias = getattr(config, "bias", "none") or "none"
    if bias != "none":
        raise LoRAFormatError(
            f"{source}: bias={bias!r} is not supported: trained bias vectors replace the base layer's bias, "
            "which request-time LoRA cannot swap; retrain with bias='none'"
        )


def _check_raw_config(raw: Mapping[str, Any], source: str) -> None:
    peft_type = raw.get("peft_type") or "LORA"
    if str(peft_type).upper() != "LORA":
        raise LoRAFormatError(f"{source}: PEFT type {peft_type!r} is not LoRA")
    if raw.get("lora_alpha") is None:
        raise LoRAFormatError(
            f"{source}: {ADAPTER_CONFIG_NAME} has no lora_alpha, so the adapter scaling lora_alpha / r is unknown "
            '(peft would silently use its default 8); add "lora_alpha" (the value used in training) to the config'
        )
    rank, alpha = raw.get("r", 8), raw["lora_alpha"]
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise LoRAFormatError(f"{source}: {ADAPTER_CONFIG_NAME} 'r' must be an integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAFormatError(
            f"{source}: {ADAPTER_CONFIG_NAME} 'lora_alpha' must be a finite number, got {alpha!r}"
        )


def lora_config_from_dict(raw: Mapping[str, Any], source: str) -> Any:
    """peft's ``LoraConfig`` from a configuration dict (``adapter_config.json`` content or the
    diffusers ``lora_adapter_metadata`` header), after the checks of the module docstring.

    Raises:
        LoRAFormatError: not a JSON object, not LoRA, no ``lora_alpha``, a non-integer ``r``, a
            non-finite ``lora_alpha``, a field peft refuses, or an unsupported feature.
    """
    if not isinstance(raw, Mapping):
        raise LoRAFormatError(f"{source}: the LoRA config must be a JSON object")
    _check_raw_config(raw, source)
    known = {f.name for f in fields(LoraConfig)}
    kwargs = {k: v for k, v in raw.items() if k in known and k not in ("peft_type", "task_type")}
    try:
        config = LoraConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise LoRAFormatError(f"{source}: invalid LoRA config: {exc}") from exc
    check_lora_config(config, source)
    return config


def read_adapter_config(config_file: str, source: str | None = None) -> tuple[Any, dict]:
    """Read an ``adapter_config.json`` (a file, or the directory holding it) with peft's ``LoraConfig``.

    Returns:
        ``(config, raw_json)``.

    Raises:
        LoRAFormatError: unreadable or invalid JSON, or what :func:`lora_config_from_dict` refuses.
    """
    if os.path.isdir(config_file):
        config_file = os.path.join(config_file, ADAPTER_CONFIG_NAME)
    source = source or config_file
    try:
        data = read_file_bytes(config_file)
    except OSError as exc:
        raise LoRAFormatError(f"{source}: {ADAPTER_CONFIG_NAME} is not readable JSON: {exc}") from exc
    return adapter_config_from_bytes(data, source)


def adapter_config_from_bytes(data: bytes, source: str) -> tuple[Any, dict]:
    """:func:`read_adapter_config` of an ``adapter_config.json`` already read: ``(config, raw_json)``.

    Raises:
        LoRAFormatError: invalid JSON, or what :func:`lora_config_from_dict` refuses.
    """
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAFormatError(f"{source}: {ADAPTER_CONFIG_NAME} is not readable JSON: {exc}") from exc
    return lora_config_from_dict(raw, source), raw


def declared_rank_alpha(config: Any, module_key: str) -> tuple[int, float]:
    """``(r, lora_alpha)`` peft gives ``module_key`` (name inside the base model, no wrapper prefix):
    ``rank_pattern`` / ``alpha_pattern`` entries first (peft's ``get_pattern_key``), else ``r`` / ``lora_alpha``.
    """
    rank, alpha = config.r, config.lora_alpha
    if config.rank_pattern:
        rank = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module_key), rank)
    if config.alpha_pattern:
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module_key), alpha)
    return int(rank), alpha


# ---------------------------------------------------------------------------- tensors
def read_file_bytes(path: str) -> bytes:
    """The whole file, read (never mapped: a file rewritten or truncated meanwhile gives other bytes,
    never a ``SIGBUS``).

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as handle:
        return handle.read()


def _safetensors_header(data: bytes) -> dict[str, Any]:
    """The JSON header of safetensors bytes (``{key: {dtype, shape, data_offsets}, "__metadata__": ...}``).

    Raises:
        ValueError: shorter than its declared header, or the header is not a JSON object.
    """
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, shorter than the 8-byte header length")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError(f"the header declares {size} bytes, the file holds {len(data) - 8} after it")
    header = json.loads(data[8 : 8 + size])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header


def safetensors_from_bytes(data: bytes, source: str) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """Tensors (CPU, as stored, each owning its memory) and header metadata of safetensors ``data``.

    Raises:
        LoRAFormatError: ``data`` is not a complete safetensors file (``source`` named).
    """
    try:
        metadata = _safetensors_header(data).get("__metadata__")
        with warnings.catch_warnings():  # the views over the immutable bytes are copied right below
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            views = safetensors.torch.load(data)
        # sorted, as safe_open's keys() were: load()'s order is a hash map's, different per call
        return {key: views[key].clone() for key in sorted(views)}, metadata
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise LoRAFormatError(f"{source}: not a readable safetensors file: {exc}") from exc


def read_safetensors(
    path: str, source: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """All tensors (CPU, as stored, in memory of their own) and the header metadata of a ``.safetensors``
    file. The file is read, never mapped: adapter files are rewritten in place by trainers, and a
    mapped tensor would change under the adapter (or raise ``SIGBUS`` once the file is truncated).

    Raises:
        LoRAFormatError: the file is not a readable safetensors file (``source`` and the file named).
    """
    shown = source if source is None or path in source else f"{source}, file {path!r}"
    try:
        data = read_file_bytes(path)
    except OSError as exc:
        raise LoRAFormatError(f"{shown or path}: cannot read the file: {exc}") from exc
    return safetensors_from_bytes(data, shown or path)


def check_safetensors_header(path: str, source: str | None = None) -> int:
    """The number of tensors a ``.safetensors`` file declares; only its header is read.

    Raises:
        LoRAFormatError: the file is not a readable safetensors file, or holds no tensor.
    """
    return len(safetensors_keys(path, source))


def safetensors_keys(path: str, source: str | None = None) -> list[str]:
    """The tensor keys a ``.safetensors`` file declares (its header is read with plain reads, never mapped).

    Raises:
        LoRAFormatError: the file is not a readable safetensors file, or holds no tensor.
    """
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            size = int.from_bytes(head, "little") if len(head) == 8 else 0
            header = _safetensors_header(head + handle.read(size))
    except (OSError, ValueError) as exc:
        raise LoRAFormatError(f"{source or path}: not a readable safetensors file: {exc}") from exc
    keys = [key for key in header if key != "__metadata__"]
    if not keys:
        raise LoRAFormatError(f"{source or path}: the safetensors file holds no tensor")
    return keys


def fingerprint_bytes(config: bytes | None, weights: bytes) -> str:
    """:func:`fingerprint_files` of contents already read (the same digest for the same bytes)."""
    digest = hashlib.sha256(b"config\0")
    if config is not None:
        digest.update(config)
    digest.update(b"weights\0")
    digest.update(weights)
    return digest.hexdigest()


def check_dtypes(state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    """Raises LoRAFormatError: a tensor is not float16/bfloat16/float32/float64 (keys and dtypes named)."""
    bad = {k: t.dtype for k, t in state_dict.items() if t.dtype not in FLOAT_DTYPES}
    if bad:
        dtypes = sorted({str(d) for d in bad.values()})
        raise LoRAFormatError(
            f"{source}: quantised or non-float adapter tensors ({', '.join(dtypes)}) are not supported; "
            f"save the adapter in float16/bfloat16/float32; offending keys: {listing(bad)}"
        )


def _check_pair(module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, source: str) -> None:
    if lora_a.ndim != 2 or lora_b.ndim != 2:
        raise LoRAFormatError(
            f"{source}: module {module!r} has lora_A {tuple(lora_a.shape)} / lora_B {tuple(lora_b.shape)}; "
            "only 2-D (linear) LoRA weights are supported"
        )
    if lora_a.shape[0] != lora_b.shape[1]:
        raise LoRAFormatError(
            f"{source}: module {module!r} has lora_A rank {lora_a.shape[0]} but lora_B rank {lora_b.shape[1]}"
        )
    if not (torch.isfinite(lora_a).all() and torch.isfinite(lora_b).all()):
        # NaN / inf weights would also corrupt the other adapters sharing a batch
        raise LoRAFormatError(f"{source}: module {module!r} holds NaN or inf weights")


def _as_float32(tensor: torch.Tensor, key: str, source: str) -> torch.Tensor:
    converted = tensor.detach().to("cpu", torch.float32, copy=True)  # never the caller's tensor
    if tensor.dtype == torch.float64 and not torch.isfinite(converted).all() and torch.isfinite(tensor).all():
        raise LoRAFormatError(
            f"{source}: tensor {key!r} holds float64 values beyond the float32 range "
            f"(max |w| = {float(tensor.abs().max()):.3g}); adapters are computed in float32 or narrower"
        )
    return converted


def update_range_problem(
    lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, dtype: torch.dtype
) -> str | None:
    """Why one module's LoRA update cannot be computed in ``dtype``, or ``None`` when it can.

    Args:
        lora_a: ``A``, ``[r, in_features]``, any float dtype.
        lora_b: ``B``, ``[out_features, r]`` (pass ``s * B`` with ``scaling=1`` when pre-scaled).
        scaling: the adapter scaling ``s`` (``lora_alpha / r`` or ``lora_alpha / sqrt(r)``).
        dtype: the floating-point dtype the stage computes the update in.

    The update must be representable: ``s``, ``A`` and ``s * B`` finite in ``dtype``; the shrink
    ``x A^T`` finite for inputs of magnitude <= 1 (``max|A| * in_features`` at most
    ``finfo(dtype).max``: an inf there becomes NaN when multiplied by a zero ``B`` or a zero scale,
    and a compiled stage's bank computes every resident slot's shrink for every row); and the bound
    ``|s| * max|B| * max|A| * in_features`` on one output of the update for inputs of magnitude <= 1
    at most ``sqrt(finfo(dtype).max)``, since the layers that follow square their inputs (norms,
    attention scores): a larger update turns a whole batch into inf / NaN in that dtype. The bounds
    are computed in float64, so the check itself never overflows.
    """
    info = torch.finfo(dtype)
    s = abs(float(scaling))
    if not math.isfinite(s) or s > info.max:
        return f"its scaling {s:.3g} is not representable in {dtype} (max {info.max:.3g})"
    max_a = float(lora_a.detach().abs().max().double()) if lora_a.numel() else 0.0
    max_b = float(lora_b.detach().abs().max().double()) if lora_b.numel() else 0.0
    if max_a > info.max or s * max_b > info.max:
        return f"its weights (max |A| {max_a:.3g}, max |s*B| {s * max_b:.3g}) overflow {dtype} (max {info.max:.3g})"
    shrink = max_a * int(lora_a.shape[-1])
    if shrink > info.max:
        return (
            f"its shrink bound max|A|*in_features = {shrink:.3g} exceeds the {dtype} max {info.max:.3g} "
            "(x A^T would overflow to inf for inputs of magnitude 1)"
        )
    bound = s * max_b * shrink
    limit = math.sqrt(info.max)
    if bound > limit:
        return (
            f"its update bound |s|*max|B|*max|A|*in_features = {bound:.3g} exceeds {limit:.3g} "
            f"(sqrt of the {dtype} max: the layers after it would overflow to inf/NaN)"
        )
    return None


def pair_lora_tensors(
    state_dict: Mapping[str, torch.Tensor], source: str, *, allow_alpha_keys: bool = False
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float]]:
    """Group ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` tensors by module.

    Args:
        state_dict: key -> tensor (an adapter-name component before ``weight`` is accepted).
        source: file or adapter name for messages.
        allow_alpha_keys: accept ``<module>.alpha`` scalar tensors (kohya / ComfyUI exports).

    Returns:
        ``(pairs, alphas)``: module key (as stored, prefixes kept) -> ``(A [r, d_in], B [d_out, r])``
        as float32 CPU tensors, and module key -> alpha for modules that carry one.

    Raises:
        LoRAFormatError: a non-float tensor, keys that are not LoRA weights (named), a module twice
            or with only one of A / B, several adapters in one file, non-2-D or rank-mismatched
            pairs, NaN / inf weights, no weights at all.
    """
    check_dtypes(state_dict, source)
    parts: dict[str, dict[str, torch.Tensor]] = {"A": {}, "B": {}}
    alphas: dict[str, float] = {}
    adapter_names: set[str] = set()
    unknown: list[str] = []
    for key, tensor in state_dict.items():
        match = LORA_KEY.match(key)
        if match:
            adapter_names.update([match["adapter"]] if match["adapter"] else [])
            target = parts[match["which"]]
            if match["module"] in target:
                raise LoRAFormatError(
                    f"{source}: module {match['module']!r} appears twice (several adapters?)"
                )
            target[match["module"]] = _as_float32(tensor, key, source)
        elif allow_alpha_keys and (alpha := _ALPHA_KEY.match(key)) and tensor.numel() == 1:
            alphas[alpha["module"]] = float(tensor.reshape(()).float().item())
        else:
            unknown.append(key)
    if unknown:
        raise LoRAFormatError(
            f"{source}: keys that are not LoRA A/B weights (embeddings, biases, DoRA magnitudes and "
            f"modules_to_save are not served): {listing(unknown)}"
        )
    if len(adapter_names) > 1:
        raise LoRAFormatError(
            f"{source}: holds several adapters ({sorted(adapter_names)}); save them separately"
        )
    lonely = sorted(set(parts["A"]) ^ set(parts["B"]))
    if lonely:
        raise LoRAFormatError(f"{source}: modules with only one of lora_A / lora_B: {lonely}")
    if not parts["A"]:
        raise LoRAFormatError(f"{source}: holds no LoRA weights")
    pairs = {m: (a, parts["B"][m]) for m, a in parts["A"].items()}
    for module, (lora_a, lora_b) in pairs.items():
        _check_pair(module, lora_a, lora_b, source)
    stray = sorted(set(alphas) - set(pairs))
    if stray:
        raise LoRAFormatError(f"{source}: alpha values for modules without LoRA weights: {stray}")
    return pairs, alphas
