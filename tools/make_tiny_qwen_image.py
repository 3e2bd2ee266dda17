"""Write a tiny, randomly initialised Qwen-Image text-to-image directory for tests.

``tiny-qwen-image`` is in the on-disk layout ``diffusers.QwenImagePipeline`` reads with
``DiffusionPipeline.from_pretrained(path)``: a 2-block ``QwenImageTransformer2DModel`` (2 heads of
32 channels), a minimal ``AutoencoderKLQwenImage`` (8x spatial compression, 16 latent channels), a
2-layer ``Qwen2_5_VLForConditionalGeneration`` text encoder (hidden size 32, with a 1-block vision
tower) and a byte-level BPE ``Qwen2Tokenizer`` built locally, plus
``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's dynamic shifting.

The pipeline drops the first 34 tokens of its prompt template (the system turn and
``<|im_start|>user\\n``), so the tokenizer carries one merge chain per word of that prefix and
encodes it in exactly 34 tokens, as Qwen's real tokenizer does (checked while building).
Image sides must be multiples of 16 (8x VAE, 2x2 patches).

Every weight comes from a fixed seed, so rebuilding gives identical files. Run as a script
(``python tools/make_tiny_qwen_image.py OUT_DIR``) or call :func:`ensure_tiny_qwen_image`; it
builds under a file lock, in a temporary directory renamed into place once complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

QWEN_IMAGE_DIR = "tiny-qwen-image"
QWEN_IMAGE_EDIT_DIR = "tiny-qwen-image-edit"
# Bump when the layout or any size changes so stale caches are rebuilt.
QWEN_IMAGE_ASSET_VERSION = "2"
TEXT_HIDDEN = 32
#: diffusers ``QwenImagePipeline.prompt_template_encode`` up to the prompt, and the number of tokens
#: the pipeline drops (``prompt_template_encode_start_idx``).
TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
TEMPLATE_PREFIX_TOKENS = 34
#: the same for diffusers ``QwenImageEditPipeline`` (its template's system turn). That pipeline drops 64
#: tokens; with one token per pre-token this tokenizer needs 66 for the prefix, so the last two
#: (``user``, ``\n``) stay in the features, in diffusers and in-tree alike.
EDIT_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
EDIT_TEMPLATE_PREFIX_TOKENS = 66
_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]
#: texts whose pre-tokens (the tokenizer's own split) each become one token, as in Qwen's vocabulary
_WHOLE = [TEMPLATE_PREFIX, EDIT_TEMPLATE_PREFIX, "assistant", " a red cat on mat blue dog"]


def _tokenizer():
    """Byte-level BPE ``Qwen2Tokenizer``: 256 byte symbols plus one left-to-right merge chain per
    pre-token of :data:`_WHOLE` (so both templates' prefixes encode in as many tokens as Qwen's)."""
    import re

    from transformers import Qwen2Tokenizer

    from tools.make_tiny_diffusion import _byte_symbols

    def make(vocab, merges):
        return Qwen2Tokenizer(
            vocab=vocab,
            merges=merges,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            unk_token=None,
            additional_special_tokens=_SPECIALS[1:],
        )

    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    pre = make(dict(vocab), []).backend_tokenizer.pre_tokenizer
    specials = "|".join(re.escape(t) for t in _SPECIALS)
    pieces = [p for text in _WHOLE for p in re.split(specials, text) if p]
    merges: list[tuple[str, str]] = []
    for word in (w for piece in pieces for w, _ in pre.pre_tokenize_str(piece)):
        current = word[0]
        for ch in word[1:]:
            if (current, ch) not in merges:
                merges.append((current, ch))
            current += ch
            vocab.setdefault(current, len(vocab))
    for tok in _SPECIALS:
        vocab[tok] = len(vocab)
    tokenizer = make(vocab, merges)
    for text, want in (
        (TEMPLATE_PREFIX, TEMPLATE_PREFIX_TOKENS),
        (EDIT_TEMPLATE_PREFIX, EDIT_TEMPLATE_PREFIX_TOKENS),
    ):
        count = len(tokenizer(text).input_ids)
        if count != want:
            raise RuntimeError(f"tiny tokenizer encodes a template prefix in {count} tokens, not {want}")
    return tokenizer


def _text_encoder(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = tokenizer.get_vocab()
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(vocab),
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "pad_token_id": vocab["<|endoftext|>"],
            "bos_token_id": vocab["<|endoftext|>"],
            "eos_token_id": vocab["<|im_end|>"],
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": TEXT_HIDDEN,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [0],
        },
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|image_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
    )
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny_qwen_image(out: Path, edit: bool = False) -> None:
    """Write the tiny ``QwenImagePipeline`` directory to ``out`` (must not exist yet); with ``edit`` the
    ``QwenImageEditPipeline`` one: the same components plus a ``processor`` (Qwen2-VL image processor
    capped at 112 x 112 pixels for the vision tower, and the tokenizer), saved without torchvision."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    out.mkdir(parents=True)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(out / "tokenizer")
    _text_encoder(tokenizer).save_pretrained(out / "text_encoder", safe_serialization=True)

    torch.manual_seed(1)
    QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=TEXT_HIDDEN,
        axes_dims_rope=(8, 12, 12),
    ).save_pretrained(out / "transformer", safe_serialization=True)

    torch.manual_seed(2)
    AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).save_pretrained(out / "vae", safe_serialization=True)

    # Qwen-Image's released scheduler settings (dynamic, exponential shift).
    FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        time_shift_type="exponential",
    ).save_pretrained(out / "scheduler")
    index = {
        "_class_name": "QwenImageEditPipeline" if edit else "QwenImagePipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    if edit:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from vllm_omni.models.torchvision_free import qwen2_vl_image_text_processor_class

        image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
        processor = qwen2_vl_image_text_processor_class()(
            image_processor=image_processor, tokenizer=tokenizer
        )
        processor.save_pretrained(out / "processor")
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def ensure_tiny_qwen_image(root: str | os.PathLike, edit: bool = False) -> Path:
    """Build (if missing or stale) and return ``root / "tiny-qwen-image"`` (``"tiny-qwen-image-edit"``
    with ``edit``: the ``QwenImageEditPipeline`` folder, same weights).

    Safe to call from several processes at once: a file lock serialises builders, the directory
    is written to a temporary sibling and renamed into place, and a version stamp triggers a
    rebuild after the layout changes.
    """
    from filelock import FileLock

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = QWEN_IMAGE_EDIT_DIR if edit else QWEN_IMAGE_DIR
    final = root / name
    with FileLock(str(root / ".tiny_qwen_image.lock")):
        stamp = final / ".asset_version"
        if not (stamp.is_file() and stamp.read_text().strip() == QWEN_IMAGE_ASSET_VERSION):
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            try:
                build_tiny_qwen_image(tmp / "model", edit=edit)
                (tmp / "model" / ".asset_version").write_text(QWEN_IMAGE_ASSET_VERSION + "\n")
                if final.exists():
                    shutil.rmtree(final)
                (tmp / "model").rename(final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


#: adapters for the tiny transformer: name -> (seed, targets). ``attn`` covers every layer kind of
#: the in-tree model (packed q/k/v of both streams, row-parallel outputs, column-parallel MLP and
#: modulation, replicated embedders); ``mlp`` touches only the MLPs (mixed-batch partner).
LORA_SPECS: dict[str, tuple[int, list[str]]] = {
    "attn": (
        11,
        ["to_q", "to_k", "add_v_proj", "add_q_proj", "to_out.0", "to_add_out", "img_mod.1", "img_in"],
    ),
    "mlp": (12, ["net.0.proj", "net.2", "txt_mod.1", "proj_out"]),
}
LORA_RANK, LORA_ALPHA, LORA_STD = 4, 8.0, 0.3
LORA_ASSET_VERSION = "1"


def build_qwen_image_lora(transformer_dir: Path, out: Path, seed: int, targets: list[str]) -> None:
    """A PEFT LoRA folder (rank 4, alpha 8, weights ~ N(0, 0.3) from ``seed``) on ``targets`` of the
    diffusers transformer in ``transformer_dir``."""
    from tools.make_tiny_diffusion_lora import _build_adapter

    _build_adapter(
        transformer_dir, out, seed, LORA_RANK, LORA_ALPHA, targets, "QwenImageTransformer2DModel", LORA_STD
    )


def write_lightx2v(directory: str, path: str) -> str:
    """lightx2v's Qwen-Image-Lightning layout: the diffusers module names with no prefix at all
    (``transformer_blocks.0.attn.to_q.lora_down.weight``), ``lora_down`` / ``lora_up`` and a per-module
    ``.alpha`` (their files: rank 64, alpha 8), from the PEFT folder ``directory``."""
    from safetensors.torch import save_file

    from tools.lora_layouts import module_alpha, read_peft

    pairs, config = read_peft(directory)
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"{module}.lora_down.weight"] = a.contiguous()
        tensors[f"{module}.lora_up.weight"] = b.contiguous()
        tensors[f"{module}.alpha"] = torch.tensor(module_alpha(config, module, a.shape[0]))
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def ensure_tiny_qwen_image_loras(model_dir: str | os.PathLike, root: str | os.PathLike) -> dict[str, Path]:
    """Build (if missing or stale) the tiny Qwen-Image adapters under ``root / "tiny-qwen-image-loras"``.

    Returns ``{name: path}``: the PEFT folders of :data:`LORA_SPECS` and, from ``attn``, the
    single-file layouts its users have (``tools/lora_layouts.py``): ``attn_diffusers``
    (``transformer.`` keys + metadata), ``attn_kohya`` (musubi-tuner / kohya ``lora_unet_`` + ``.alpha``),
    ``attn_comfyui`` (``diffusion_model.`` + ``.alpha``) and ``attn_lightx2v`` (:func:`write_lightx2v`).
    """
    from filelock import FileLock

    from tools.lora_layouts import write_comfyui, write_diffusers, write_kohya

    root = Path(root)
    final = root / "tiny-qwen-image-loras"
    files = {
        "attn_diffusers": write_diffusers,
        "attn_kohya": write_kohya,
        "attn_comfyui": write_comfyui,
        "attn_lightx2v": write_lightx2v,
    }
    paths = {name: final / name for name in LORA_SPECS}
    paths.update({name: final / f"{name}.safetensors" for name in files})
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".tiny_qwen_image_loras.lock")):
        stamp = final / ".asset_version"
        if not (stamp.is_file() and stamp.read_text().strip() == LORA_ASSET_VERSION):
            tmp = Path(tempfile.mkdtemp(prefix=".tiny-qwen-image-loras-", dir=root))
            try:
                for name, (seed, targets) in LORA_SPECS.items():
                    build_qwen_image_lora(Path(model_dir) / "transformer", tmp / name, seed, targets)
                for name, writer in files.items():
                    writer(str(tmp / "attn"), str(tmp / f"{name}.safetensors"))
                (tmp / ".asset_version").write_text(LORA_ASSET_VERSION + "\n")
                if final.exists():
                    shutil.rmtree(final)
                tmp.rename(final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        for name, writer in files.items():  # a layout added since the folder was built: written beside
            if not paths[name].is_file():
                part = final / f".{name}.partial"
                os.replace(writer(str(final / "attn"), str(part)), paths[name])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to hold tiny-qwen-image/")
    print(ensure_tiny_qwen_image(parser.parse_args().out))


if __name__ == "__main__":
    main()
