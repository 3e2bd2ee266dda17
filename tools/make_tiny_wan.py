"""Write a tiny, randomly initialised Wan text-to-video directory for tests.

``tiny-wan`` is in the on-disk layout ``diffusers.WanPipeline`` reads with
``DiffusionPipeline.from_pretrained(path)``: a 2-layer ``WanTransformer3DModel``, a
minimal ``AutoencoderKLWan`` (8x spatial, 4x temporal compression), a 2-layer
``UMT5EncoderModel`` and a T5-style unigram tokenizer built locally with the
``tokenizers`` library (a fixed character/word vocabulary; nothing is downloaded), plus
``FlowMatchEulerDiscreteScheduler``.

``tiny-wan-moe`` is the Wan2.2 two-denoiser form of the same model: a second
``WanTransformer3DModel`` (``transformer_2``, another seed) and ``boundary_ratio`` 0.5, so
``WanPipeline`` runs the high-noise steps on ``transformer`` and the low-noise steps on
``transformer_2``.

``tiny-wan-ti2v`` is the Wan2.2 TI2V-5B form, its ``model_index.json`` written as the published
``Wan-AI/Wan2.2-TI2V-5B-Diffusers`` one (``_class_name: "WanPipeline"``, ``expand_timesteps: true``,
``boundary_ratio: null``, no image encoder): diffusers runs it as ``WanPipeline`` (text-to-video) and as
``WanImageToVideoPipeline`` (image-to-video) from the same folder. One denoiser whose input is the latent alone (48 channels, no mask or image
channels, no image encoder) and a Wan2.2-style VAE (48 latent channels, ``is_residual``, a 2x2 pixel
patch in front of the 8x compression: 16x spatial, 4x temporal).

Every weight comes from a fixed seed, so rebuilding gives identical files. Run as a
script (``python tools/make_tiny_wan.py OUT_DIR``) or call :func:`ensure_tiny_wan`; it
builds under a file lock, in a temporary directory renamed into place once complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import string
import tempfile
from pathlib import Path

import torch

WAN_DIR = "tiny-wan"
WAN_MOE_DIR = "tiny-wan-moe"
WAN_I2V_DIR = "tiny-wan-i2v"
WAN_I2V_MOE_DIR = "tiny-wan-i2v-moe"
WAN_TI2V_DIR = "tiny-wan-ti2v"
#: latent channels of the Wan2.2 (TI2V-5B) VAE
TI2V_Z_DIM = 48
# Bump when the layout or any size changes so stale caches are rebuilt.
WAN_ASSET_VERSION = "1"
#: ``tiny-wan-ti2v``'s own stamp (2: ``_class_name`` ``WanPipeline``, as published), so that the other
#: folders are not rebuilt for it
WAN_TI2V_ASSET_VERSION = "2"

_WORDS = ("a", "the", "red", "blue", "green", "cat", "dog", "on", "mat", "ball", "video", "of", "running")


def _tokenizer():
    """A T5-style fast tokenizer over a small unigram vocabulary (pad=0, eos=1, unk=2)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import T5TokenizerFast

    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("\u2581" + w, -2.0) for w in _WORDS]
    vocab += [("\u2581", -3.0)]
    vocab += [(c, -5.0) for c in string.ascii_lowercase + string.digits + string.punctuation]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.Replace("  ", " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return T5TokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=512,
    )


def build_tiny_wan(out: Path, moe: bool = False, i2v: bool = False, ti2v: bool = False) -> None:
    """Write the tiny Wan directory to ``out``; ``moe``: the two-denoiser (Wan2.2) form; ``i2v``: the
    image-to-video form (``WanImageToVideoPipeline``: denoiser input 16 noise + 4 mask + 16 image-latent
    channels; with one denoiser also a tiny CLIP image encoder and image cross-attention, as Wan2.1 I2V);
    ``ti2v``: the Wan2.2 TI2V-5B image-to-video form (module docstring; not with ``moe`` / ``i2v``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    out.mkdir(parents=True)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(out / "tokenizer")

    torch.manual_seed(0)
    text_dim = 32
    enc_config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=text_dim,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    UMT5EncoderModel(enc_config).eval().save_pretrained(out / "text_encoder", safe_serialization=True)

    for seed, name in [(1, "transformer"), (3, "transformer_2")][: 2 if moe else 1]:
        torch.manual_seed(seed)
        image_kwargs = {"image_dim": 24, "added_kv_proj_dim": 16} if i2v and not moe else {}
        WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=TI2V_Z_DIM if ti2v else 36 if i2v else 16,
            out_channels=TI2V_Z_DIM if ti2v else 16,
            text_dim=text_dim,
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
            **image_kwargs,
        ).save_pretrained(out / name, safe_serialization=True)

    _write_vae(out, ti2v)
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0).save_pretrained(out / "scheduler")
    encoder = i2v and not moe
    if encoder:
        _write_image_encoder(out)
    index = {
        "_class_name": "WanImageToVideoPipeline" if i2v else "WanPipeline",
        "_diffusers_version": "0.42.1",
        "boundary_ratio": 0.5 if moe else None,
        "expand_timesteps": ti2v,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"] if moe else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if i2v or ti2v:
        index["image_encoder"] = ["transformers", "CLIPVisionModel"] if encoder else [None, None]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"] if encoder else [None, None]
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_vae(out: Path, ti2v: bool) -> None:
    """The tiny ``AutoencoderKLWan`` (seed 2): Wan2.1-style (16 latent channels, 8x spatial), or with ``ti2v``
    Wan2.2-style (``TI2V_Z_DIM`` channels, ``is_residual``, 2x2 pixel patch: 16x spatial) with per-channel
    latent statistics of its own (the defaults have 16)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(2)
    wan22 = {}
    if ti2v:
        stats = torch.Generator().manual_seed(5)
        wan22 = {
            "z_dim": TI2V_Z_DIM,
            "is_residual": True,
            "in_channels": 12,
            "out_channels": 12,
            "patch_size": 2,
            "scale_factor_spatial": 16,
            "latents_mean": (torch.randn(TI2V_Z_DIM, generator=stats) * 0.5).tolist(),
            "latents_std": (torch.rand(TI2V_Z_DIM, generator=stats) + 0.5).tolist(),
        }
    AutoencoderKLWan(
        **{
            "base_dim": 8,
            "z_dim": 16,
            "dim_mult": [1, 1, 1, 1],
            "num_res_blocks": 1,
            "temperal_downsample": [False, True, True],
            **wan22,
        }
    ).save_pretrained(out / "vae", safe_serialization=True)


def _write_image_encoder(out: Path) -> None:
    """A 2-layer ``CLIPVisionModel`` (hidden 24, 32 px images in 8 px patches) and its image processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(4)
    config = CLIPVisionConfig(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    CLIPVisionModel(config).eval().save_pretrained(out / "image_encoder", safe_serialization=True)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        out / "image_processor"
    )


def ensure_tiny_wan(
    root: str | os.PathLike, moe: bool = False, i2v: bool = False, ti2v: bool = False
) -> Path:
    """Build (if missing or stale) and return ``root / "tiny-wan"`` (``"tiny-wan-moe"`` with ``moe``;
    ``"tiny-wan-i2v"`` / ``"tiny-wan-i2v-moe"`` with ``i2v``; ``"tiny-wan-ti2v"`` with ``ti2v``, alone).

    Safe to call from several processes at once: a file lock serialises builders, the
    directory is written to a temporary sibling and renamed into place, and a version
    stamp triggers a rebuild after the layout changes.
    """
    from filelock import FileLock

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if ti2v and (moe or i2v):
        raise ValueError("ti2v is a layout of its own: not with moe or i2v")
    name = {(False, False): WAN_DIR, (True, False): WAN_MOE_DIR, (False, True): WAN_I2V_DIR}.get(
        (moe, i2v), WAN_I2V_MOE_DIR
    )
    name = WAN_TI2V_DIR if ti2v else name
    final = root / name
    version = WAN_TI2V_ASSET_VERSION if ti2v else WAN_ASSET_VERSION
    with FileLock(str(root / ".tiny_wan.lock")):
        stamp = final / ".asset_version"
        if not (stamp.is_file() and stamp.read_text().strip() == version):
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            try:
                build_tiny_wan(tmp / name, moe=moe, i2v=i2v, ti2v=ti2v)
                (tmp / name / ".asset_version").write_text(version + "\n")
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp / name, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_lora(model_dir: Path, subfolder: str, seed: int, out: Path) -> None:
    """A rank-4 LoRA (alpha 8, weights ~ N(0, 0.3)) on the attention projections and the first FFN layer of
    one denoiser, saved as diffusers saves Wan LoRAs (``transformer.blocks.N....lora_A.weight``)."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    torch.manual_seed(seed)
    model = WanTransformer3DModel.from_pretrained(model_dir, subfolder=subfolder)
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj"]
    model = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False), model
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    WanPipeline.save_lora_weights(
        out.parent, transformer_lora_layers=get_peft_model_state_dict(model), weight_name=out.name
    )


def ensure_tiny_wan_loras(root: str | os.PathLike) -> dict[str, Path]:
    """``{"high": file, "low": file}``: one diffusers-format LoRA file per denoiser of ``tiny-wan-moe``
    (``high_noise.safetensors`` for ``transformer``, ``low_noise.safetensors`` for ``transformer_2``), built
    once under ``root / "tiny-wan-moe-loras"`` (file-locked, versioned like the model)."""
    from filelock import FileLock

    model_dir = ensure_tiny_wan(root, moe=True)
    folder = Path(root) / "tiny-wan-moe-loras"
    files = {"high": folder / "high_noise.safetensors", "low": folder / "low_noise.safetensors"}
    with FileLock(str(Path(root) / ".tiny_wan_loras.lock")):
        stamp = folder / ".asset_version"
        if not (stamp.is_file() and stamp.read_text().strip() == WAN_ASSET_VERSION):
            for path, (subfolder, seed) in zip(files.values(), [("transformer", 10), ("transformer_2", 11)]):
                _write_lora(model_dir, subfolder, seed, path)
            stamp.write_text(WAN_ASSET_VERSION + "\n")
    return files


def write_lightx2v_style_lora(model_dir: Path, subfolder: str, seed: int, out: Path, rank: int = 4) -> Path:
    """A distill-style LoRA file for one denoiser of a tiny Wan directory, in the layout of lightx2v's Wan
    distill files (ComfyUI names under ``diffusion_model.``), random weights from ``seed``, float32.

    Per block, on ``self_attn.{q,k,v,o}``, ``cross_attn.{q,k,v,o}``, ``ffn.0`` and ``ffn.2``:
    ``lora_down.weight`` ``[rank, in]``, ``lora_up.weight`` ``[out, rank]``, ``alpha`` (``2 * rank``) and a
    bias delta ``diff_b`` ``[out]``; plus deltas of the kinds diffusers' converter drops (``norm3.diff`` /
    ``norm3.diff_b``, ``cross_attn.norm_q.diff``, ``modulation.diff``), and the output head as a full
    weight delta with its bias delta (``head.head.diff`` ``[out, dim]``, ``head.head.diff_b``), which it
    keeps. Returns ``out``.
    """
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / subfolder / "config.json").read_text())
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    head_out = config["out_channels"] * int(torch.tensor(config["patch_size"]).prod())
    shapes = {f"{a}.{p}": (dim, dim) for a in ("self_attn", "cross_attn") for p in "qkvo"}
    shapes |= {"ffn.0": (dim, config["ffn_dim"]), "ffn.2": (config["ffn_dim"], dim)}
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    tensors: dict[str, torch.Tensor] = {}
    for block in range(config["num_layers"]):
        b = f"diffusion_model.blocks.{block}"
        for name, (d_in, d_out) in shapes.items():
            tensors[f"{b}.{name}.lora_down.weight"] = rand(rank, d_in, std=0.4)
            tensors[f"{b}.{name}.lora_up.weight"] = rand(d_out, rank, std=0.4)
            tensors[f"{b}.{name}.alpha"] = torch.tensor(float(2 * rank))
            tensors[f"{b}.{name}.diff_b"] = rand(d_out, std=0.3)
        tensors[f"{b}.norm3.diff"] = rand(dim, std=0.3)
        tensors[f"{b}.norm3.diff_b"] = rand(dim, std=0.3)
        tensors[f"{b}.cross_attn.norm_q.diff"] = rand(dim, std=0.3)
        tensors[f"{b}.modulation.diff"] = rand(1, 6, dim, std=0.3)
    tensors["diffusion_model.head.head.diff"] = rand(head_out, dim, std=0.1)
    tensors["diffusion_model.head.head.diff_b"] = rand(head_out, std=0.1)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write tiny-wan/ (or tiny-wan-moe/) into")
    parser.add_argument("--moe", action="store_true", help="the Wan2.2 two-denoiser form (transformer_2)")
    parser.add_argument(
        "--i2v", action="store_true", help="the image-to-video form (WanImageToVideoPipeline)"
    )
    parser.add_argument(
        "--ti2v", action="store_true", help="the Wan2.2 TI2V-5B form (WanPipeline with expand_timesteps)"
    )
    args = parser.parse_args()
    print(ensure_tiny_wan(args.out, moe=args.moe, i2v=args.i2v, ti2v=args.ti2v))


if __name__ == "__main__":
    main()
