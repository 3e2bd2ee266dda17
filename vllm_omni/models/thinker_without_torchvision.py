"""Audio and image inputs of the Omni thinkers (Qwen2.5-Omni, Qwen3-Omni) without torchvision.

transformers' ``Qwen2_5OmniProcessor`` and ``Qwen3OmniMoeProcessor`` declare a video processor
(``Qwen2VLVideoProcessor``), which needs torchvision: without it, ``from_pretrained`` fails, so
vLLM can build no multimodal processor for the thinker. :func:`thinker_class_without_torchvision`
gives the thinker class a multimodal processor whose Hugging Face processor is the same class
without that video processor (:func:`processor_without_video`): the Whisper feature extractor,
the image processor (transformers' PIL one, see :mod:`vllm_omni.models.torchvision_free`) and
the tokenizer load as they do with torchvision, and the placeholders are expanded by
transformers' own code. Video input is refused with :class:`VideoNeedsTorchvision` (an
``VLLMValidationError``): the request fails before it starts; the engine keeps serving. Audio
items are checked before vLLM parses them (:func:`check_audio_items`): audio the encoder cannot
take is refused naming the item and why, instead of failing deeper (or, for NaN samples,
answering garbage).

Used **only when torchvision is not installed**; with it, the thinker modules export vLLM's
classes unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers.processing_utils import VideosKwargs
from vllm.exceptions import VLLMValidationError
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing.context import InputProcessingContext

#: Why video is refused (the message of :class:`VideoNeedsTorchvision`).
VIDEO_REFUSAL = (
    "video input needs torchvision (the Omni thinker's video processor, Qwen2VLVideoProcessor, is built on it), "
    "which is not installed on this CPU install; audio and image inputs work. Install torchvision (the CUDA "
    "extra has it) for video"
)


class VideoNeedsTorchvision(VLLMValidationError):
    """A video input reached a thinker whose processor was built without torchvision."""

    def __init__(self) -> None:
        super().__init__(VIDEO_REFUSAL, parameter="video")


class RefusedVideoProcessor:
    """Stands in for the processor's ``video_processor`` attribute (not a declared sub-processor:
    never loaded, saved or type-checked). transformers' placeholder expansion reads its
    ``merge_size`` for every multimodal prompt (image and audio too); calling it refuses video."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    valid_kwargs = VideosKwargs

    def __init__(self, merge_size: int, temporal_patch_size: int) -> None:
        self.merge_size = merge_size
        self.temporal_patch_size = temporal_patch_size
        self.size: dict[str, int] = {}

    def __call__(self, *args: object, **kwargs: object) -> Any:
        raise VideoNeedsTorchvision()


def _audio_items(data: object) -> list:
    return list(data) if isinstance(data, list) else [data]


def check_audio_items(data: object, target_sr: float) -> None:
    """Refuse audio the thinker's encoder cannot take, naming the item and why: anything but a real
    numeric array of 1 (mono) or 2 (channels, samples) dimensions, empty, with NaN or infinite
    samples, or given with a sample rate that is not a positive number; a rate other than
    ``target_sr`` (the Whisper feature extractor's) when vLLM's resampler (torchaudio) is not
    installed. Precomputed embeddings (dicts) are left to vLLM.

    Raises:
        VLLMValidationError: ``parameter="audio"``.
    """
    import importlib.util

    import numpy as np

    for index, item in enumerate(_audio_items(data)):
        where = f"audio item {index}"
        if isinstance(item, dict):
            continue
        sr = None
        if isinstance(item, tuple):
            if len(item) != 2:
                raise VLLMValidationError(
                    f"{where}: give (samples, sample_rate), got a {len(item)}-tuple", parameter="audio"
                )
            item, sr = item
        if isinstance(item, (str, bytes)) or not hasattr(item, "__len__"):
            raise VLLMValidationError(
                f"{where}: expected an array of samples (numpy, torch or a list of floats), got {type(item).__name__}",
                parameter="audio",
            )
        arr = item.detach().cpu().numpy() if hasattr(item, "detach") else np.asarray(item)
        if arr.dtype.kind not in "fiu":
            raise VLLMValidationError(
                f"{where}: samples must be real numbers, got dtype {arr.dtype}", parameter="audio"
            )
        if arr.ndim not in (1, 2) or arr.size == 0:
            raise VLLMValidationError(
                f"{where}: expected samples of shape [n] or [channels, n] with n > 0, got shape {tuple(arr.shape)}",
                parameter="audio",
            )
        if not np.isfinite(arr).all():
            raise VLLMValidationError(f"{where}: the samples hold NaN or infinite values", parameter="audio")
        if sr is None:
            continue
        if isinstance(sr, bool) or not isinstance(sr, (int, float)) or not np.isfinite(sr) or sr <= 0:
            raise VLLMValidationError(
                f"{where}: sample rate {sr!r} is not a positive number (Hz)", parameter="audio"
            )
        if abs(float(sr) - float(target_sr)) > 1e-6 and importlib.util.find_spec("torchaudio") is None:
            raise VLLMValidationError(
                f"{where}: sample rate {sr} Hz: the thinker's feature extractor takes {target_sr:g} Hz and vLLM's "
                "resampler (torchaudio) is not installed; resample the audio to "
                f"{target_sr:g} Hz before sending it",
                parameter="audio",
            )


_WITHOUT_VIDEO: dict[type, type] = {}

#: Token attributes the Omni processors copy from the tokenizer in their ``__init__``.
_TOKEN_NAMES = (
    "image_token",
    "audio_token",
    "video_token",
    "vision_bos_token",
    "vision_eos_token",
    "audio_bos_token",
    "audio_eos_token",
)


def processor_without_video(processor_cls: type) -> type:
    """``processor_cls`` (``Qwen2_5OmniProcessor`` or ``Qwen3OmniMoeProcessor``) without its
    video processor.

    transformers' ``ProcessorMixin`` takes the sub-processors it loads from ``__init__``'s
    parameters; this subclass's ``__init__`` names only ``image_processor``,
    ``feature_extractor`` and ``tokenizer``, then sets ``video_processor`` to a
    :class:`RefusedVideoProcessor` with the image processor's merge and temporal patch sizes.
    Everything else (``__call__``, the placeholder expansion) is the original's.
    """
    cached = _WITHOUT_VIDEO.get(processor_cls)
    if cached is not None:
        return cached
    from transformers.processing_utils import ProcessorMixin

    def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None):
        ProcessorMixin.__init__(
            self, image_processor, feature_extractor, tokenizer, chat_template=chat_template
        )
        for name in _TOKEN_NAMES:
            if hasattr(self.tokenizer, name):
                setattr(self, name, getattr(self.tokenizer, name))
        self.video_processor = RefusedVideoProcessor(
            getattr(image_processor, "merge_size", 2), getattr(image_processor, "temporal_patch_size", 2)
        )

    sub = type(
        processor_cls.__name__,
        (processor_cls,),
        {"__init__": __init__, "__module__": __name__, "__doc__": processor_without_video.__doc__},
    )
    _WITHOUT_VIDEO[processor_cls] = sub
    return sub


def _context_swapping(ctx: InputProcessingContext, swap: dict[type, type]) -> InputProcessingContext:
    """A copy of ``ctx`` whose ``get_hf_processor(cls)`` loads ``swap[cls]`` in place of ``cls``."""

    class SwappingContext(type(ctx)):  # type: ignore[misc]
        def get_hf_processor(self, typ=None, /, **kwargs):
            return super().get_hf_processor(swap.get(typ, typ), **kwargs)

    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
    return SwappingContext(**fields)


def thinker_class_without_torchvision(model_cls: type, processor_cls: type, module: str) -> type:
    """A subclass of vLLM's thinker ``model_cls`` (same name, defined in ``module``) whose multimodal processor loads
    :func:`processor_without_video` of ``processor_cls`` and refuses, before the request starts, video items
    (:class:`VideoNeedsTorchvision`), audio the encoder cannot take (:func:`check_audio_items`) and items without
    a placeholder in the prompt. The model itself is unchanged."""
    factories = model_cls._processor_factory
    swap = {processor_cls: processor_without_video(processor_cls)}

    class Info(factories.info):  # type: ignore[misc, name-defined]
        def __init__(self, ctx: InputProcessingContext) -> None:
            super().__init__(_context_swapping(ctx, swap))

        def get_supported_mm_limits(self):  # no video entry: vLLM takes video as not supported
            return {k: v for k, v in super().get_supported_mm_limits().items() if k != "video"}

        def parse_mm_data(self, mm_data, *args, **kwargs):
            if mm_data.get("audio") is not None:
                check_audio_items(mm_data["audio"], self.get_feature_extractor().sampling_rate)
            return super().parse_mm_data(mm_data, *args, **kwargs)

        def validate_num_items(self, modality: str, num_items: int) -> None:
            if modality == "video" and num_items > 0:
                raise VideoNeedsTorchvision()
            super().validate_num_items(modality, num_items)

    class Processor(factories.processor):  # type: ignore[misc, name-defined]
        def _matched_updates_from_result(self, mm_prompt_updates, match_result):
            # vLLM asserts here (an AssertionError, HTTP 500) when an item has no placeholder
            for modality, update_idxs in match_result.items():
                missing = [i for i, u in enumerate(update_idxs) if u is None]
                if missing:
                    token = getattr(self.info.get_hf_processor(), f"{modality}_token", modality)
                    raise VLLMValidationError(
                        f"{modality} item {missing[0]}: the prompt has no {token} placeholder for it "
                        f"(one per {modality} item)",
                        parameter=modality,
                    )
            return super()._matched_updates_from_result(mm_prompt_updates, match_result)

    Info.__name__ = Info.__qualname__ = f"{factories.info.__name__}WithoutTorchvision"
    Processor.__name__ = Processor.__qualname__ = f"{factories.processor.__name__}WithoutTorchvision"
    sub = type(model_cls.__name__, (model_cls,), {"__module__": module, "__doc__": model_cls.__doc__})
    register = MULTIMODAL_REGISTRY.register_processor(
        Processor, info=Info, dummy_inputs=factories.dummy_inputs
    )
    return register(sub)
