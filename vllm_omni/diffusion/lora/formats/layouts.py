"""Key layouts of single-file LoRA checkpoints, and the checks every adapter tensor passes first.

Layouts (the names used in :attr:`~..adapter.LoRAAdapterWeights.layout`), by where they come from:

* ``"peft"``: peft's ``save_pretrained`` (``get_peft_model_state_dict``) writes
  ``base_model.model.<module>.lora_A.weight`` / ``...lora_B.weight``;
* ``"diffusers"``: diffusers' ``save_lora_weights`` writes ``transformer.<module>.lora_A.weight`` and the
  LoRA config as JSON under ``lora_adapter_metadata`` in the safetensors header;
* ``"comfyui"``: ComfyUI / musubi-tuner / ai-toolkit exports use the original model's names under
  ``diffusion_model.`` with either ``lora_A`` / ``lora_B`` or ``lora_down`` / ``lora_up`` and ``.alpha``;
* ``"kohya"``: kohya-ss sd-scripts (and A1111, which reads them) flatten the module path with
  underscores under ``lora_unet_`` (``lora_unet_layers_0_attention_to_q.lora_down.weight``), store
  ``lora_down`` (= A) / ``lora_up`` (= B) and a per-module scalar ``.alpha``. LyCORIS' own network
  wrapper (``lycoris.create_lycoris`` on any ``nn.Module``) writes the same flattened paths under
  ``lycoris_`` (``lycoris_layers_0_attention_to_q.hada_w1_a``); :func:`canonical_flat_prefix` reads
  them as their ``lora_unet_`` form.

:func:`screen_state_dict` refuses what this runtime cannot apply exactly, naming the file and the keys;
:func:`normalize_lora_keys` renames ``lora_down`` / ``lora_up`` to ``lora_A`` / ``lora_B``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

import torch

from vllm_omni.errors import LoRAFormatError
from vllm_omni.lora.adapter_files import check_dtypes
from vllm_omni.lora.adapter_files import listing as _listing

KOHYA_UNET_PREFIX = "lora_unet_"
#: LyCORIS' prefix for a wrapped generic module (``LycorisNetwork.LORA_PREFIX``), flattened like kohya's.
LYCORIS_PREFIX = "lycoris_"
COMFYUI_PREFIX = "diffusion_model."
DIFFUSERS_PREFIX = "transformer."
PEFT_PREFIX = "base_model.model."

# (predicate on the key, what it is, what the user can do). First match wins.
_REFUSED_KEYS: tuple[tuple[Callable[[str], bool], str, str], ...] = (
    (
        lambda k: "lora_magnitude_vector" in k or "dora_scale" in k,
        "DoRA magnitude vectors (weight-decomposed LoRA)",
        "DoRA cannot be applied as request-time LoRA; merge it into the base weights offline or retrain as LoRA",
    ),
    (
        lambda k: "modules_to_save" in k,
        "modules_to_save weights (whole replacement modules)",
        "only low-rank deltas can be swapped per request; save the adapter without modules_to_save",
    ),
    (
        lambda k: bool(re.search(r"\.lora_(B|up)(\.[^.]+)?\.bias$", k)) or k.endswith(".diff_b"),
        "LoRA bias terms",
        "this runtime applies y = Wx + s*B(Ax) only; train with lora_bias=False / no bias diffs",
    ),
    (
        lambda k: k.endswith(".diff"),
        "full weight differences (.diff)",
        "full-rank deltas are not LoRA; fuse them into the checkpoint offline",
    ),
    (
        lambda k: any(t in k for t in (".oft_", "oft_blocks", "lora_mid", ".lokr.", "lora_embedding_")),
        "OFT / embedding / conv adapter tensors (OFT, LoRA Tucker cores, embedding LoRA)",
        "linear LoRA, LoHa and LoKr are supported; convert to one of them or fuse offline",
    ),
    (
        lambda k: k.startswith(("te.", "te1.", "te2.")),
        "text-encoder keys in a layout this runtime does not read",
        "save them as diffusers' text_encoder.* / text_encoder_2.* keys or kohya's lora_te_* / lora_te1_* / "
        "lora_te2_* keys",
    ),
    (
        lambda k: any(t in k for t in ("weight_scale", "scale_weight", "absmax", "quant_state", "quant_map")),
        "quantisation state (scales / absmax)",
        "save the adapter unquantised (float16/bfloat16/float32)",
    ),
)


def screen_state_dict(state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    """Refuse tensors that cannot be applied exactly, naming ``source`` and the offending keys.

    Raises:
        LoRAFormatError: DoRA (``lora_magnitude_vector`` / kohya ``dora_scale``), ``modules_to_save``,
            LoRA bias (``lora_B.bias``, ``.diff_b``), full diffs, OFT / Tucker-core / embedding tensors
            (LoHa / LoKr keys pass, :mod:`.lycoris` checks them), text-encoder keys in an unread layout
            (``te.`` / ``te1.`` / ``te2.``; the read ones are split off first, :mod:`.text_encoders`),
            quantisation state, or a tensor whose dtype is not float16/bfloat16/float32/float64.
    """
    refusal = key_refusal(state_dict, source)
    if refusal is not None:
        raise refusal
    check_dtypes(state_dict, source)


def key_refusal(keys: Iterable[str], source: str, note: str = "") -> LoRAFormatError | None:
    """The error :func:`screen_state_dict` raises for these keys (the first refused kind, its keys named,
    ``note`` appended to the fix), or ``None`` when no key is refused."""
    found: dict[int, list[str]] = {}
    for key in keys:
        for n, (predicate, _, _) in enumerate(_REFUSED_KEYS):
            if predicate(key):
                found.setdefault(n, []).append(key)
                break
    if not found:
        return None
    n = min(found)
    _, what, fix = _REFUSED_KEYS[n]
    return LoRAFormatError(
        f"{source}: {what} are not supported ({fix}{note}); offending keys: {_listing(found[n])}"
    )


#: Suffixes of lightx2v's full-weight (``.diff``) and bias (``.diff_b``) deltas in ComfyUI-layout files.
DELTA_SUFFIXES = (".diff", ".diff_b")


def split_deltas(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(rest, deltas)``: the ComfyUI-layout (``diffusion_model.``) ``.diff`` / ``.diff_b`` tensors set
    aside, for a model family converter that reads them (:mod:`.model_keys`); other keys stay in ``rest``."""
    rest: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        target = deltas if key.startswith(COMFYUI_PREFIX) and key.endswith(DELTA_SUFFIXES) else rest
        target[key] = tensor
    return rest, deltas


def detect_layout(keys: Iterable[str]) -> str:
    """``"kohya"``, ``"comfyui"``, ``"diffusers"`` or ``"peft"`` (see the module docstring)."""
    keys = list(keys)
    if any(k.startswith(KOHYA_UNET_PREFIX) for k in keys):
        return "kohya"
    if any(k.startswith(COMFYUI_PREFIX) for k in keys):
        return "comfyui"
    if any(k.startswith(PEFT_PREFIX) for k in keys):
        return "peft"
    return "diffusers"


_DOWN_UP = re.compile(r"\.lora_(down|up)\.weight$")
#: XLabs' Flux files: ``double_blocks.0.processor.qkv_lora1.down.weight`` (diffusers' Flux converter reads them)
_XLABS_DOWN_UP = re.compile(r"(\.processor\.[a-z]+_lora\d*)\.(down|up)\.weight$")


def normalize_lora_keys(state_dict: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Rename kohya's ``<m>.lora_down.weight`` / ``<m>.lora_up.weight`` (and XLabs'
    ``<m>.processor.<x>_lora<n>.down.weight`` / ``.up.weight``) to ``<m>.lora_A.weight`` /
    ``<m>.lora_B.weight`` (the down projection is A, ``[r, d_in]``; up is B, ``[d_out, r]``).

    Raises:
        LoRAFormatError: one module stored in both namings.
    """
    out: dict[str, torch.Tensor] = {}
    clashes: list[str] = []
    for key, tensor in state_dict.items():
        new = _DOWN_UP.sub(lambda m: ".lora_A.weight" if m.group(1) == "down" else ".lora_B.weight", key)
        new = _XLABS_DOWN_UP.sub(
            lambda m: m.group(1) + (".lora_A.weight" if m.group(2) == "down" else ".lora_B.weight"), new
        )
        if new in out:
            clashes.append(key)
        out[new] = tensor
    if clashes:
        raise LoRAFormatError(
            f"{source}: modules stored both as lora_down/up and lora_A/B: {_listing(clashes)}"
        )
    return out


def strip_kohya_prefix(module_key: str) -> str | None:
    """The flattened module path of a kohya key (``lora_unet_a_b`` -> ``a_b``), else ``None``."""
    return module_key[len(KOHYA_UNET_PREFIX) :] if module_key.startswith(KOHYA_UNET_PREFIX) else None


def canonical_flat_prefix(state_dict: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """``state_dict`` with every ``lycoris_<flat>`` key renamed ``lora_unet_<flat>`` (same tensors).

    LyCORIS flattens a module path exactly as kohya does, so after the rename both files take the one
    kohya path (un-flattening against the model, ``.alpha`` scaling, LoHa / LoKr factors).

    Raises:
        LoRAFormatError: a module stored under both prefixes (names both keys).
    """
    if not any(k.startswith(LYCORIS_PREFIX) for k in state_dict):
        return dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    clashes: list[str] = []
    for key, tensor in state_dict.items():
        new = KOHYA_UNET_PREFIX + key[len(LYCORIS_PREFIX) :] if key.startswith(LYCORIS_PREFIX) else key
        if new in out:
            clashes.append(f"{key} / {new}")
        out[new] = tensor
    if clashes:
        raise LoRAFormatError(
            f"{source}: modules stored under both {LYCORIS_PREFIX!r} and {KOHYA_UNET_PREFIX!r}: {_listing(clashes)}"
        )
    return out
