"""Write tiny, randomly initialised diffusion model directories for tests.

Two layouts are produced, both in the on-disk format that ``diffusers`` reads with
``DiffusionPipeline.from_pretrained(path)`` (``model_index.json`` plus one folder per
component, weights as safetensors):

* ``tiny-z-image``: ``ZImagePipeline`` (Qwen3 text encoder with a byte-level BPE
  tokenizer and chat template, ``ZImageTransformer2DModel``, 4-block ``AutoencoderKL``,
  ``FlowMatchEulerDiscreteScheduler``).
* ``tiny-sd3``: ``StableDiffusion3Pipeline`` without the T5 encoder (two CLIP encoders).

Every weight comes from a fixed seed, so rebuilding gives identical files. Nothing is
downloaded. Run as a script (``python tools/make_tiny_diffusion.py OUT_DIR``) or call
:func:`ensure_tiny_diffusion_assets` from tests; it builds missing directories under a
file lock, in a temporary directory that is renamed into place once complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

Z_IMAGE_DIR = "tiny-z-image"
SD3_DIR = "tiny-sd3"
# Bump when the layout or any size changes so stale caches are rebuilt.
ASSET_VERSION = "1"

# Minimal chat template in the Qwen style; accepts (and, like Qwen3, only reacts to a
# false) ``enable_thinking`` as ZImagePipeline passes it.
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins GPT-2 style byte-level BPE uses for raw bytes, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def _bpe_vocab(end_of_word: str = "") -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small byte-level BPE: 256 byte symbols, a few deterministic merges.

    With ``end_of_word`` (CLIP style) every symbol also exists with that suffix.
    """
    symbols = _byte_symbols()
    vocab: dict[str, int] = {}
    for s in symbols:
        vocab[s] = len(vocab)
    if end_of_word:
        for s in symbols:
            vocab[s + end_of_word] = len(vocab)
    space = symbols[ord(" ")]
    pairs = [(space, c) for c in "abcdefghijklmnopqrstuvwxyz"]
    pairs += [("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("a", "t")]
    merges: list[tuple[str, str]] = []
    for a, b in pairs:
        if end_of_word and a == space:
            continue
        merged = a + b
        if merged not in vocab:
            vocab[merged] = len(vocab)
            if end_of_word:
                vocab[merged + end_of_word] = len(vocab)
        merges.append((a, b))
    return vocab, merges


def _write_model_index(root: Path, class_name: str, components: dict[str, tuple[str, str] | None]) -> None:
    import diffusers

    index: dict[str, object] = {"_class_name": class_name, "_diffusers_version": diffusers.__version__}
    for name, spec in components.items():
        index[name] = list(spec) if spec is not None else [None, None]
    (root / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _tiny_flux_style_vae(latent_channels: int, seed: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def build_tiny_z_image(out: Path) -> None:
    """Write a tiny ``ZImagePipeline`` directory to ``out`` (must not exist yet)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

    out.mkdir(parents=True)
    vocab, merges = _bpe_vocab()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    for tok in specials:
        vocab[tok] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=specials[1:],
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(out / "tokenizer")

    hidden = 32
    torch.manual_seed(0)
    text_cfg = Qwen3Config(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=vocab["<|endoftext|>"],
    )
    text_encoder = Qwen3Model(text_cfg).eval()
    text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)

    torch.manual_seed(1)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=64,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=hidden,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[8, 12, 12],
        axes_lens=[1024, 64, 64],
    )
    # Zero-initialised pad tokens would hide padding bugs: give them values.
    with torch.no_grad():
        transformer.x_pad_token.normal_(0, 0.5)
        transformer.cap_pad_token.normal_(0, 0.5)
    transformer.save_pretrained(out / "transformer", safe_serialization=True)

    _tiny_flux_style_vae(16, seed=2).save_pretrained(out / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False
    ).save_pretrained(out / "scheduler")
    _write_model_index(
        out,
        "ZImagePipeline",
        {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": ("transformers", "Qwen3Model"),
            "tokenizer": ("transformers", "Qwen2Tokenizer"),
            "transformer": ("diffusers", "ZImageTransformer2DModel"),
            "vae": ("diffusers", "AutoencoderKL"),
        },
    )


def build_tiny_sd3(out: Path) -> None:
    """Write a tiny ``StableDiffusion3Pipeline`` directory (no T5) to ``out`` (must not exist yet)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    out.mkdir(parents=True)
    vocab, merges = _bpe_vocab(end_of_word="</w>")
    for tok in ("<|startoftext|>", "<|endoftext|>"):
        vocab[tok] = len(vocab)
    for i, name in enumerate(("text_encoder", "text_encoder_2")):
        tokenizer = CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=77)
        tokenizer.save_pretrained(out / name.replace("text_encoder", "tokenizer"))
        torch.manual_seed(10 + i)
        cfg = CLIPTextConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            projection_dim=32,
            max_position_embeddings=77,
            hidden_act="gelu",
            bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=vocab["<|endoftext|>"],
            pad_token_id=vocab["<|endoftext|>"],
        )
        CLIPTextModelWithProjection(cfg).eval().save_pretrained(out / name, safe_serialization=True)

    torch.manual_seed(20)
    SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
        pos_embed_max_size=32,
    ).save_pretrained(out / "transformer", safe_serialization=True)
    torch.manual_seed(21)
    AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).save_pretrained(out / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0).save_pretrained(out / "scheduler")
    _write_model_index(
        out,
        "StableDiffusion3Pipeline",
        {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": ("transformers", "CLIPTextModelWithProjection"),
            "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
            "text_encoder_3": None,
            "tokenizer": ("transformers", "CLIPTokenizer"),
            "tokenizer_2": ("transformers", "CLIPTokenizer"),
            "tokenizer_3": None,
            "transformer": ("diffusers", "SD3Transformer2DModel"),
            "vae": ("diffusers", "AutoencoderKL"),
        },
    )


_BUILDERS = {Z_IMAGE_DIR: build_tiny_z_image, SD3_DIR: build_tiny_sd3}


def ensure_tiny_diffusion_assets(root: str | os.PathLike) -> dict[str, Path]:
    """Build (if missing) and return the tiny model directories under ``root``.

    Returns ``{"z_image": Path, "sd3": Path}``. Safe to call from several processes at
    once: a file lock serialises builders, each directory is written to a temporary
    sibling and renamed into place, and a version stamp triggers a rebuild after the
    layout changes.
    """
    from filelock import FileLock

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".tiny_diffusion.lock")):
        for name, builder in _BUILDERS.items():
            final = root / name
            stamp = final / ".asset_version"
            if stamp.is_file() and stamp.read_text().strip() == ASSET_VERSION:
                continue
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            try:
                builder(tmp / name)
                (tmp / name / ".asset_version").write_text(ASSET_VERSION + "\n")
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp / name, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return {"z_image": root / Z_IMAGE_DIR, "sd3": root / SD3_DIR}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write tiny-z-image/ and tiny-sd3/ into")
    args = parser.parse_args()
    for key, path in ensure_tiny_diffusion_assets(args.out).items():
        print(f"{key}: {path}")


if __name__ == "__main__":
    main()
