"""Importing vLLM's Qwen2-VL family without torchvision.

vLLM 0.32's ``qwen2_vl`` model module (imported by Qwen2.5-VL and the Qwen2.5-Omni thinker)
takes ``smart_resize`` from ``transformers.models.qwen2_vl.image_processing_qwen2_vl``, the
torchvision image processor, which imports torchvision at module level. On a CPU machine there
is no usable torchvision: the wheels the package index offers are CUDA builds whose compiled
ops do not load beside torch 2.13+cpu (``operator torchvision::nms does not exist``), and
``tools/setup.sh`` removes them.

transformers ships the same processor without torchvision
(``image_processing_pil_qwen2_vl``: same ``smart_resize``, ``Qwen2VLImageProcessorPil``), and
itself falls back to it when torchvision is absent. :func:`ensure_qwen2_vl_importable` makes
the torchvision module name resolve to that one, **only when torchvision is not installed**; with
torchvision installed (the CUDA extra) it does nothing. Image inputs then go through the PIL
processor, as transformers' own fallback does.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

from vllm_omni.errors import ConfigError

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_LOCK = threading.Lock()


def torchvision_available() -> bool:
    """Whether a ``torchvision`` package is installed (its import may still fail: not checked)."""
    return importlib.util.find_spec("torchvision") is not None


def ensure_qwen2_vl_importable() -> bool:
    """Alias :data:`TORCHVISION_MODULE` to the PIL processor module when torchvision is absent.

    Returns:
        True when the alias is in place (now or before); False when torchvision is installed
        or the module was already imported (nothing to do).
    """
    with _LOCK:
        current = sys.modules.get(TORCHVISION_MODULE)
        if current is not None:
            return bool(getattr(current, "vllm_omni_alias_of", None))
        if torchvision_available():
            return False
        pil = importlib.import_module(PIL_MODULE)
        alias = types.ModuleType(TORCHVISION_MODULE, pil.__doc__)
        alias.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
        alias.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        alias.vllm_omni_alias_of = PIL_MODULE
        sys.modules[TORCHVISION_MODULE] = alias
        return True


#: ``limit_mm_per_prompt`` of an Omni thinker stage (Qwen2.5-Omni, Qwen3-Omni) that does not set
#: it, without torchvision: one audio clip, no image (they work when the stage allows them; vLLM's
#: start-up profile of the largest image costs ~20 s of CPU), no video. Its transformers processor
#: builds a video processor, which needs torchvision; the thinker then loads the processor without it
#: (:mod:`vllm_omni.models.thinker_without_torchvision`) and refuses video.
LIMITS_WITHOUT_TORCHVISION = {"audio": 1, "image": 0, "video": 0}


def video_off_without_torchvision(stage_label: str, engine_kwargs: dict) -> bool:
    """Without torchvision, take video out of an Omni thinker stage's inputs (in ``engine_kwargs``).

    Sets ``limit_mm_per_prompt`` to :data:`LIMITS_WITHOUT_TORCHVISION` when the stage does not
    set it, and its ``video`` entry to 0 when the stage sets the others only; a no-op when
    torchvision is installed.

    Returns:
        True when video is off for want of torchvision.

    Raises:
        ConfigError: the stage asks for video inputs (a non-zero ``video`` limit) and
            torchvision is not installed.
    """
    if torchvision_available():
        return False
    limits = engine_kwargs.get("limit_mm_per_prompt")
    if limits is None:
        engine_kwargs["limit_mm_per_prompt"] = dict(LIMITS_WITHOUT_TORCHVISION)
        return True
    limits = dict(limits)
    video = limits.get("video")
    if isinstance(video, dict):  # vLLM's per-modality options: {"count": n, ...}
        video = video.get("count")
    if video:
        raise ConfigError(
            f"{stage_label}: limit_mm_per_prompt {{'video': {limits['video']!r}}} asks for video inputs, which the "
            "Omni thinker's processor (Qwen2.5-Omni, Qwen3-Omni) cannot take without torchvision (not installed; "
            "audio and image inputs work); install torchvision (the CUDA extra has it) or set the video limit to 0"
        )
    engine_kwargs["limit_mm_per_prompt"] = {**limits, "video": 0}
    return True


_IMAGE_TEXT_PROCESSOR: type | None = None


def qwen2_vl_image_text_processor_class() -> type:
    """transformers' ``Qwen2VLProcessor`` without its video processor (images and text only).

    ``Qwen2VLProcessor`` always builds a video processor, which needs torchvision; this subclass
    declares only ``image_processor`` and ``tokenizer`` (transformers' ``ProcessorMixin`` takes its
    sub-processors from ``__init__``'s arguments), so it loads and saves without torchvision and
    expands ``<|image_pad|>`` exactly as the original does (its ``replace_image_token``).
    """
    global _IMAGE_TEXT_PROCESSOR
    if _IMAGE_TEXT_PROCESSOR is None:
        from transformers import Qwen2VLProcessor

        class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
            def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
                super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        _IMAGE_TEXT_PROCESSOR = Qwen2VLImageTextProcessor
    return _IMAGE_TEXT_PROCESSOR


def load_qwen2_vl_processor(folder: str):
    """A Qwen2-VL processor folder: ``Qwen2VLProcessor`` with torchvision installed, else
    :func:`qwen2_vl_image_text_processor_class` (images and text; a video input is refused by it)."""
    if torchvision_available():
        from transformers import Qwen2VLProcessor

        return Qwen2VLProcessor.from_pretrained(folder)
    return qwen2_vl_image_text_processor_class().from_pretrained(folder)
