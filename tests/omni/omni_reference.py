"""Reference greedy decoding of a tiny Omni thinker (Qwen2.5-Omni, Qwen3-Omni) with transformers (+ peft), float32."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=4)
def thinker(model_dir: str, adapter_dir: str | None = None, layout: str = "full"):
    """transformers' thinker of the checkpoint (the class its ``config.json`` names), with the
    adapter applied by peft.

    ``layout="full"``: peft on the whole model (adapter keys ``...thinker.model.layers...``);
    ``"thinker"``: peft on the thinker sub-model alone (keys ``...model.layers...``).
    """
    import transformers

    (arch,) = transformers.AutoConfig.from_pretrained(model_dir).architectures
    full = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        PeftModel.from_pretrained(full if layout == "full" else full.thinker, adapter_dir)
    return full.thinker.eval()


@torch.inference_mode()
def thinker_greedy(
    model_dir: str | os.PathLike,
    prompt_ids: list[int],
    max_new_tokens: int,
    adapter_dir: str | os.PathLike | None = None,
    layout: str = "full",
) -> list[int]:
    """Greedy-decode ``max_new_tokens`` tokens after ``prompt_ids`` (no stop); the new ids."""
    model = thinker(str(model_dir), None if adapter_dir is None else str(adapter_dir), layout)
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt_ids) :].tolist()


def sine_noise_clip(seconds: float = 1.0, rate: int = 16000, seed: int = 0):
    """A mono float32 test clip: a 440 Hz sine (amplitude 0.5) plus seeded Gaussian noise (0.05)."""
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.5 * np.sin(2 * np.pi * 440 * t) + 0.05 * noise).astype(np.float32)


def qwen2_5_omni_audio_inputs(model_dir: str | os.PathLike, before: str, after: str, clip) -> dict:
    """transformers' inputs of the Qwen2.5-Omni thinker for ``before <|audio_bos|><|AUDIO|><|audio_eos|> after``
    with ``clip`` (16 kHz): ``input_features`` / ``feature_attention_mask`` from the checkpoint's
    ``WhisperFeatureExtractor`` (padding ``max_length``, as ``Qwen2_5OmniProcessor`` calls it), and
    ``input_ids`` with ``<|AUDIO|>`` repeated as that processor expands it
    (``((frames - 1) // 2 + 1 - 2) // 2 + 1`` tokens for ``frames`` mel frames)."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    tok = AutoTokenizer.from_pretrained(model_dir)
    fe = WhisperFeatureExtractor.from_pretrained(model_dir)
    feats = fe(
        clip, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt"
    )
    frames = int(feats["attention_mask"].sum(-1))
    n = ((frames - 1) // 2 + 1 - 2) // 2 + 1
    ids = tok.encode(before, add_special_tokens=False)
    ids += tok.convert_tokens_to_ids(["<|audio_bos|>"] + ["<|AUDIO|>"] * n + ["<|audio_eos|>"])
    ids += tok.encode(after, add_special_tokens=False)
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "input_features": feats["input_features"],
        "feature_attention_mask": feats["attention_mask"],
    }


@torch.inference_mode()
def thinker_greedy_from(model_dir: str | os.PathLike, inputs: dict, max_new_tokens: int) -> list[int]:
    """Greedy-decode ``max_new_tokens`` tokens with transformers' thinker on full ``inputs``; the new ids."""
    model = thinker(str(model_dir))
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def qwen3_omni_audio_inputs(model_dir: str | os.PathLike, before: str, after: str, clip) -> dict:
    """As :func:`qwen2_5_omni_audio_inputs` for Qwen3-Omni (``<|audio_start|><|audio_pad|><|audio_end|>``):
    ``Qwen3OmniMoeProcessor`` calls the feature extractor with ``padding=True`` (no padding for one
    clip) and expands ``<|audio_pad|>`` to transformers' ``_get_feat_extract_output_lengths(frames, 50)``."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    tok = AutoTokenizer.from_pretrained(model_dir)
    fe = WhisperFeatureExtractor.from_pretrained(model_dir)
    feats = fe(clip, sampling_rate=16000, return_attention_mask=True, padding=True, return_tensors="pt")
    n = int(_get_feat_extract_output_lengths(feats["attention_mask"].sum(-1), 50))
    ids = tok.encode(before, add_special_tokens=False)
    ids += tok.convert_tokens_to_ids(["<|audio_start|>"] + ["<|audio_pad|>"] * n + ["<|audio_end|>"])
    ids += tok.encode(after, add_special_tokens=False)
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "input_features": feats["input_features"],
        "feature_attention_mask": feats["attention_mask"],
    }


def qwen2_5_omni_image_inputs(
    model_dir: str | os.PathLike, before: str, after: str, image, max_pixels: int
) -> dict:
    """transformers' inputs of the Qwen2.5-Omni thinker for ``before <|vision_bos|><|IMAGE|><|vision_eos|> after``:
    ``pixel_values`` / ``image_grid_thw`` from transformers' ``Qwen2VLImageProcessorPil`` (the processor
    transformers itself uses without torchvision) with the checkpoint's settings and ``max_pixels``, and
    ``<|IMAGE|>`` repeated ``grid_t * grid_h * grid_w / merge_size**2`` times, as the processor expands it."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir, max_pixels=max_pixels)
    pix = proc(images=[image], return_tensors="pt")
    n = int(pix["image_grid_thw"].prod()) // proc.merge_size**2
    ids = tok.encode(before, add_special_tokens=False)
    ids += tok.convert_tokens_to_ids(["<|vision_bos|>"] + ["<|IMAGE|>"] * n + ["<|vision_eos|>"])
    ids += tok.encode(after, add_special_tokens=False)
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "pixel_values": pix["pixel_values"],
        "image_grid_thw": pix["image_grid_thw"],
    }
