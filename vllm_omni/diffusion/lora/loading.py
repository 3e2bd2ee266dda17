"""Choose an adapter reader by path: a PEFT directory, a single ``.safetensors`` file, or a folder
holding exactly one ``.safetensors`` file and no ``adapter_config.json`` (read as that file).

A single file may use any key layout of :mod:`.formats.layouts` (PEFT, diffusers, ComfyUI, kohya/A1111);
names are resolved against the model when the adapter is bound (:mod:`.formats.model_keys`). The accepted
formats and refusals are listed in ``docs/user_guide/lora_formats.md``.

New formats register a reader with :func:`register_lora_format`; the first reader whose predicate
accepts the path wins, so a more specific format (e.g. kohya files recognised by their keys) can be
registered ahead of the generic single-file reader with ``first=True``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from vllm_omni.diffusion.lora.adapter import LoRAAdapterWeights
from vllm_omni.diffusion.lora.safetensors_format import load_lora_safetensors, load_peft_adapter
from vllm_omni.errors import LoRAFormatError
from vllm_omni.lora.adapter_files import ADAPTER_CONFIG_NAME, SAFETENSORS_SUFFIX, locate_adapter

logger = logging.getLogger(__name__)

LoRAReader = Callable[[str], LoRAAdapterWeights]


def load_single_file_folder(path: str) -> LoRAAdapterWeights:
    """Read a folder that holds exactly one ``.safetensors`` file and no ``adapter_config.json`` as
    that file (what :func:`load_lora_safetensors` returns for the file's own path), logging which file.

    Raises:
        LoRAFormatError: the folder holds no or several ``.safetensors`` files (they are named), or
            see :func:`load_lora_safetensors`.
    """
    files = locate_adapter(path)
    logger.info(
        "LoRA folder %s has no %s: loading its single file %s", path, ADAPTER_CONFIG_NAME, files.weights
    )
    return load_lora_safetensors(files.weights)


_READERS: list[tuple[str, Callable[[str], bool], LoRAReader]] = [
    (
        "peft",
        lambda p: os.path.isdir(p) and os.path.isfile(os.path.join(p, ADAPTER_CONFIG_NAME)),
        load_peft_adapter,
    ),
    ("safetensors", lambda p: os.path.isfile(p) and p.endswith(SAFETENSORS_SUFFIX), load_lora_safetensors),
    ("single-file folder", os.path.isdir, load_single_file_folder),
]


def register_lora_format(
    name: str, accepts: Callable[[str], bool], reader: LoRAReader, *, first: bool = False
) -> None:
    """Add a reader: ``accepts(path)`` says whether it handles ``path``; ``reader(path)`` parses it."""
    entry = (name, accepts, reader)
    if first:
        _READERS.insert(0, entry)
    else:
        _READERS.append(entry)


def load_lora_adapter(path: str | os.PathLike[str]) -> LoRAAdapterWeights:
    """Read the adapter at ``path`` with the first registered reader that accepts it.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        LoRAFormatError: no reader accepts it, or the reader rejects its content.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"LoRA adapter not found: {path!r}")
    for _, accepts, reader in _READERS:
        if accepts(path):
            return reader(path)
    locate_adapter(path)  # names what is wrong (pickle weights, a missing file), if it can
    known = ", ".join(name for name, _, _ in _READERS)
    raise LoRAFormatError(
        f"{path!r} is neither a PEFT adapter directory ({ADAPTER_CONFIG_NAME} + adapter_model.safetensors) nor a "
        f"supported single-file LoRA (known formats: {known})"
    )
