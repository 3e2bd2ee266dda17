"""Deterministic writer of a tiny random Qwen2.5-Omni checkpoint (thinker, talker, token2wav).

The directory loads with transformers' ``Qwen2_5OmniForConditionalGeneration.from_pretrained``
(``spk_dict.pt`` included) and with vLLM (``Qwen2_5OmniForConditionalGeneration`` maps to vLLM's
thinker, which drops the talker and token2wav weights). Sizes are the smallest that both accept:

- the thinker's and the talker's decoders use 4 heads of 32 (vLLM's CPU attention needs a head
  size of at least 32) and ``mrope_section`` sums to ``head_dim / 2``;
- the thinker config carries ``vision_start_token_id`` / ``vision_end_token_id`` (vLLM reads them);
- the tokenizer names the image/audio/video special tokens (the processor reads them);
- every BigVGAN dilation set has 3 entries;
- the talker's codec vocabulary is tiny, so its stop tokens are :data:`TALKER_EOS_TOKEN_IDS`
  (pass them as ``talker_eos_token_id`` to transformers' ``generate``: its default ids
  ``[8292, 8294]`` are the real model's).

Weights are seeded Gaussian noise (std :data:`WEIGHT_STD`); norms are 1. The tokenizer is the
byte-level BPE of :mod:`tools.make_tiny_llm` plus the Omni special tokens. Running the writer
twice gives byte-identical files.

CLI::

    python -m tools.make_tiny_qwen2_5_omni DIR
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tools.make_tiny_llm import BPE_VOCAB_SIZE, _atomic_build, _fill_random_, _write_json, write_tokenizer

#: Bump when the output changes, so that stale cached assets get rebuilt.
OMNI_ASSETS_VERSION = "1"
MODEL_SEED = 4321
WEIGHT_STD = 0.15

#: Special tokens after the BPE vocabulary, in id order (ids BPE_VOCAB_SIZE ...).
OMNI_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|tts_pad|>",
    "<|tts_text_bos|>",
    "<|tts_text_eod|>",
    "<|tts_text_bos_single|>",
)
#: Named multimodal tokens of the tokenizer (``tokenizer.image_token`` ...), read by the processor.
NAMED_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}

#: The speaker of ``spk_dict.pt`` (transformers' default speaker name).
SPEAKER = "Chelsie"
SPEAKERS = ("Chelsie", "Ethan")

# Decoder sizes shared by the thinker's text model and the talker.
HIDDEN = 128
HEADS = 4
HEAD_DIM = 32
MROPE_SECTION = [4, 6, 6]  # sums to HEAD_DIM / 2

# The talker's codec vocabulary: codes 0..59 are sound codes, then its special tokens.
CODEC_VOCAB = 64
CODEC_PAD, CODEC_START, CODEC_END, CODEC_MASK = 60, 61, 62, 63
#: The talker's stop tokens on this checkpoint (``talker_eos_token_id`` of transformers' generate).
TALKER_EOS_TOKEN_IDS = (CODEC_PAD, CODEC_END)

DIT_MEL_DIM = 80
SPK_EMB_DIM = 16  # the DiT's ``enc_emb_dim``: the speaker conditioning vector's size
REF_MEL_FRAMES = 30


def _rope(theta: float = 1_000_000.0) -> dict:
    return {"rope_type": "default", "rope_theta": theta, "mrope_section": list(MROPE_SECTION)}


def omni_config_dict(ids: dict[str, int]) -> dict:
    """The ``Qwen2_5OmniConfig`` keyword arguments of the tiny checkpoint (``ids``: token ids)."""
    vocab_size = BPE_VOCAB_SIZE + len(OMNI_SPECIAL_TOKENS)
    text = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _rope(),
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "initializer_range": WEIGHT_STD,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": HIDDEN,
        "fullatt_block_indexes": [0],
        "initializer_range": WEIGHT_STD,
    }
    audio = {
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 128,
        "d_model": 64,
        "output_dim": HIDDEN,
        "initializer_range": WEIGHT_STD,
    }
    thinker = {
        "text_config": text,
        "vision_config": vision,
        "audio_config": audio,
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
        "user_token_id": ids["<|im_start|>"],
        "initializer_range": WEIGHT_STD,
    }
    talker = {
        "vocab_size": CODEC_VOCAB,
        "embedding_size": HIDDEN,
        "hidden_size": HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 512,
        "rope_parameters": _rope(),
        "tts_text_start_token_id": ids["<|tts_text_bos|>"],
        "tts_text_end_token_id": ids["<|tts_text_eod|>"],
        "tts_text_pad_token_id": ids["<|tts_pad|>"],
        "tts_codec_start_token_id": CODEC_START,
        "tts_codec_end_token_id": CODEC_END,
        "tts_codec_pad_token_id": CODEC_PAD,
        "tts_codec_mask_token_id": CODEC_MASK,
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "initializer_range": WEIGHT_STD,
    }
    dit = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 32,
        "ff_mult": 2,
        "emb_dim": 32,
        "block_size": 24,
        "look_ahead_layers": [1],
        "look_backward_layers": [0],
        "repeats": 2,
        "num_embeds": CODEC_VOCAB,
        "mel_dim": DIT_MEL_DIM,
        "dropout": 0.0,
        "enc_emb_dim": SPK_EMB_DIM,
        "enc_dim": 32,
        "enc_channels": [32, 32, 32, 32, 96],
        "enc_attention_channels": 16,
        "enc_se_channels": 16,
    }
    bigvgan = {
        "mel_dim": DIT_MEL_DIM,
        "upsample_initial_channel": 64,
        "resblock_kernel_sizes": [3],
        "resblock_dilation_sizes": [[1, 3, 5]],
        "upsample_rates": [5, 3, 2, 2, 2, 2],
        "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
    }
    return {
        "thinker_config": thinker,
        "talker_config": talker,
        "token2wav_config": {"dit_config": dit, "bigvgan_config": bigvgan},
        "enable_audio_output": True,
    }


def _speakers(ids: dict[str, int]) -> dict:
    """``spk_dict.pt`` contents: per speaker the talker's text bos id, a conditioning vector
    ``[1, SPK_EMB_DIM]`` and a reference mel ``[1, REF_MEL_FRAMES, DIT_MEL_DIM]`` (float32)."""
    import torch

    gen = torch.Generator().manual_seed(MODEL_SEED + 7)
    out = {}
    for name in SPEAKERS:
        out[name] = {
            "bos_token": ids["<|tts_text_bos_single|>"],
            "cond": torch.randn(1, SPK_EMB_DIM, generator=gen),
            "ref_mel": torch.randn(1, REF_MEL_FRAMES, DIT_MEL_DIM, generator=gen),
        }
    return out


def make_tiny_qwen2_5_omni(path: str | os.PathLike) -> Path:
    """Write the tiny Qwen2.5-Omni checkpoint into ``path`` (created; files overwritten).

    Returns:
        ``path`` as a :class:`~pathlib.Path`. Files: ``config.json``, ``generation_config.json``,
        ``model.safetensors`` (float32), tokenizer files, ``preprocessor_config.json``,
        ``spk_dict.pt``.
    """
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    from tools.make_tiny_llm import CHAT_TEMPLATE

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, OMNI_SPECIAL_TOKENS, {"extra_special_tokens": dict(NAMED_TOKENS)})
    cfg = Qwen2_5OmniConfig(**omni_config_dict(ids))
    write_random_model(out, Qwen2_5OmniForConditionalGeneration, cfg, ids, MODEL_SEED, WEIGHT_STD)
    torch.save(_speakers(ids), out / "spk_dict.pt")
    _write_json(out / "preprocessor_config.json", preprocessor_config("Qwen2_5OmniProcessor"))
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    return out


def write_random_model(out: Path, model_cls, cfg, ids: dict[str, int], seed: int, std: float) -> None:
    """Save ``model_cls(cfg)`` into ``out``: float32, seeded Gaussian noise of std ``std`` (norm
    weights 1), greedy generation config stopping at ``<|im_end|>`` / ``<|endoftext|>``
    (``ids``: token ids), ``architectures`` = the class name."""
    import torch

    cfg.architectures = [model_cls.__name__]
    cfg.dtype = "float32"
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    params = list(model.named_parameters())
    norms = [(n, p) for n, p in params if "norm" in n.rsplit(".", 2)[-2] and n.endswith("weight")]
    norm_names = {n for n, _ in norms}
    _fill_random_([(n, p) for n, p in params if n not in norm_names], seed, std)
    with torch.no_grad():
        for _, p in norms:
            p.fill_(1.0)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


def preprocessor_config(processor_class: str, **image: object) -> dict:
    """Feature extractor (Whisper, 128 mel bins) and image processor settings of the processor
    (``image``: image-processor entries that differ from Qwen2.5-Omni's)."""
    return {
        "processor_class": processor_class,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 300,
        "n_fft": 400,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    } | image


# --------------------------------------------------------------------------------------
# Thinker adapters
# --------------------------------------------------------------------------------------

#: peft's key prefix for the thinker's decoder in an adapter of the whole model, and in one
#: saved from the thinker sub-model alone.
FULL_MODEL_PREFIX = "base_model.model.thinker.model.layers."
THINKER_ALONE_PREFIX = "base_model.model.model.layers."


def make_thinker_adapter(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules=("q_proj", "v_proj"),
    seed: int = 505,
    layout: str = "full",
) -> Path:
    """Write a PEFT LoRA adapter on the thinker's text decoder into ``out_dir``.

    Args:
        target_modules: module names; they are bound to the thinker's decoder layers only
            (a regex), so the audio/vision encoders' ``q_proj``/``v_proj`` are left alone.
        layout: ``"full"``: keys as peft saves them for the thinker sub-module of the whole
            model (``base_model.model.thinker.model.layers...``); ``"thinker"``: as saved from the
            thinker model alone (``base_model.model.model.layers...``).

    ``lora_A`` and ``lora_B`` are seeded Gaussian noise (peft's default ``lora_B`` is zero).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5OmniForConditionalGeneration

    if layout not in ("full", "thinker"):
        raise ValueError(f"layout must be 'full' or 'thinker', got {layout!r}")
    full = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    base, prefix = (full, r"thinker\.") if layout == "full" else (full.thinker, "")
    names = "|".join(sorted(target_modules))
    lcfg = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=rf"{prefix}model\.layers\.\d+\.(self_attn|mlp)\.({names})",
        lora_dropout=0.0,
        bias="none",
    )
    peft_model = get_peft_model(base, lcfg)
    lora = [(n, p) for n, p in peft_model.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    if not lora:
        raise RuntimeError("no LoRA parameters were created")
    # Names sort alike in both layouts (one common prefix): both get the same weights.
    _fill_random_(lora, seed, WEIGHT_STD)
    return save_adapter(peft_model, out_dir, "tiny-qwen2_5-omni")


def save_adapter(peft_model, out_dir: str | os.PathLike, base_name: str) -> Path:
    """Save ``peft_model``'s adapter into ``out_dir`` with ``base_model_name_or_path`` set to
    ``base_name``, config keys (and a list of target modules) sorted, no README (byte-identical
    across runs)."""
    out = Path(out_dir)
    peft_model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base_name
    if isinstance(cfg.get("target_modules"), list):  # peft writes a set's order
        cfg["target_modules"] = sorted(cfg["target_modules"])
    _write_json(cfg_path, dict(sorted(cfg.items())))
    (out / "README.md").unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------------------
# Cached assets
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyOmniAssets:
    model_dir: Path
    thinker_adapter: Path  # full-model keys (base_model.model.thinker.model.layers...)
    thinker_alone_adapter: Path  # the same weights, keys as saved from the thinker alone


def ensure_tiny_omni_assets(root: str | os.PathLike) -> TinyOmniAssets:
    """Build (only what is missing of) the tiny checkpoint and its adapters under ``root``.

    Safe under pytest-xdist (file lock; temp dir then rename), as :mod:`tools.make_tiny_llm`.
    """
    from filelock import FileLock

    base = Path(root) / f"tiny_qwen2_5_omni_v{OMNI_ASSETS_VERSION}"
    base.mkdir(parents=True, exist_ok=True)
    assets = TinyOmniAssets(base / "model", base / "thinker_adapter", base / "thinker_alone_adapter")
    with FileLock(str(base / ".lock")):
        _atomic_build(assets.model_dir, make_tiny_qwen2_5_omni)
        _atomic_build(assets.thinker_adapter, lambda tmp: make_thinker_adapter(assets.model_dir, tmp))
        _atomic_build(
            assets.thinker_alone_adapter,
            lambda tmp: make_thinker_adapter(assets.model_dir, tmp, layout="thinker"),
        )
    return assets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="directory for the checkpoint")
    parser.add_argument("--adapters", action="store_true", help="also write thinker adapters beside it")
    args = parser.parse_args(argv)
    make_tiny_qwen2_5_omni(args.out)
    print(f"model: {args.out}")
    if args.adapters:
        for layout in ("full", "thinker"):
            path = args.out.parent / f"{args.out.name}_thinker_adapter_{layout}"
            make_thinker_adapter(args.out, path, layout=layout)
            print(f"adapter ({layout}): {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
