"""Write tiny, randomly initialised diffusers folders from the PUBLISHED configs of a DiT family.

For a :class:`~vllm_omni.config.dit_family.PublishedCheckpoint` (a family spec's ``PUBLISHED``
list) the folder keeps every behaviour-selecting value the published one has -- the pipeline class and
``model_index.json`` keys (``boundary_ratio``, ``expand_timesteps``...), the whole
``scheduler_config.json`` (class, shifts, flow sigmas, ``shift_terminal``...), the denoiser's structural
keys (patch size, channels, norms, image cross-attention) -- and shrinks only sizes (width, depth, text
width). Every norm weight and bias is drawn away from 1 / 0, so a norm applied wrongly shows.
Text encoders, tokenizers and VAEs are the family's tiny ones (``tools/make_tiny_<family>.py`` helpers).

Run as a script (``python tools/make_tiny_dit.py OUT_DIR Wan2.2-T2V-A14B-Diffusers``) or call
:func:`ensure_tiny_published`; it builds under a file lock, in a temporary directory renamed into place.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

#: bump when a builder changes so stale caches are rebuilt
ASSET_VERSION = "1"
#: the shrunk sizes of a Wan denoiser (heads x head_dim = 32 wide, 2 blocks, text 32 wide)
WAN_SIZES = {
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "ffn_dim": 48,
    "num_layers": 2,
    "text_dim": 32,
}


def perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Draw every norm weight around 1 (``1 + 0.3 N``) and bias around 0 (``0.2 N``), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                continue
            noise = torch.randn(param.shape, generator=g)
            param.copy_(1 + 0.3 * noise if name.endswith("weight") else 0.2 * noise)


def _wan_denoiser(published: dict[str, Any], seed: int, out: Path) -> None:
    from diffusers import WanTransformer3DModel

    config = {k: v for k, v in published.items() if not k.startswith("_")}
    config |= WAN_SIZES
    config["rope_max_seq_len"] = 32
    if config.get("image_dim") is not None:
        config["image_dim"] = 24  # the tiny CLIP's width
        config["added_kv_proj_dim"] = WAN_SIZES["num_attention_heads"] * WAN_SIZES["attention_head_dim"]
    torch.manual_seed(seed)
    model = WanTransformer3DModel.from_config(config)
    perturb_norms(model, seed + 100)
    model.save_pretrained(out, safe_serialization=True)


def build_wan(checkpoint, out: Path) -> None:
    """A tiny folder of a published Wan checkpoint (``vllm_omni.diffusion.models.wan.spec.PUBLISHED``)."""
    from diffusers import UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from tools.make_tiny_wan import _tokenizer, _write_image_encoder, _write_vae

    out.mkdir(parents=True)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(out / "tokenizer")
    torch.manual_seed(0)
    enc = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=WAN_SIZES["text_dim"],
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
    UMT5EncoderModel(enc).eval().save_pretrained(out / "text_encoder", safe_serialization=True)
    for seed, name in ((1, "transformer"), (3, "transformer_2")):
        if name in checkpoint.components:
            _wan_denoiser(checkpoint.denoiser, seed, out / name)
    _write_vae(out, ti2v=checkpoint.denoiser["in_channels"] == 48)
    if "image_encoder" in checkpoint.components:
        _write_image_encoder(out)
    scheduler = {k: v for k, v in checkpoint.scheduler.items() if not k.startswith("_")}
    UniPCMultistepScheduler(**scheduler).save_pretrained(out / "scheduler")
    _write_index(out, checkpoint)


def _write_index(out: Path, checkpoint) -> None:
    (out / "model_index.json").write_text(json.dumps(checkpoint.model_index(), indent=2) + "\n")


def _published_denoiser(
    cls, published: dict[str, Any], sizes: dict[str, Any], seed: int, out: Path, init=None
):
    """``cls`` from the published config with ``sizes`` replacing the size keys; norms perturbed; saved."""
    config = {k: v for k, v in published.items() if not k.startswith("_")} | sizes
    torch.manual_seed(seed)
    model = cls.from_config(config)  # as loading the published file does: unknown keys are ignored
    if init is not None:
        init(model)
    perturb_norms(model, seed + 100)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)


def _published_scheduler(checkpoint, out: Path) -> None:
    import diffusers

    config = checkpoint.scheduler
    cls = getattr(diffusers, config["_class_name"])
    if out.exists():
        shutil.rmtree(out)
    cls.from_config({k: v for k, v in config.items() if not k.startswith("_")}).save_pretrained(out)


def build_z_image(checkpoint, out: Path) -> None:
    """A tiny Z-Image folder: the tiny text encoder, tokenizer and VAE of ``make_tiny_diffusion``; the denoiser,
    scheduler and ``model_index.json`` from the published config (sizes shrunk: width 64, 2 + 1 layers)."""
    from diffusers import ZImageTransformer2DModel

    from tools.make_tiny_diffusion import build_tiny_z_image

    build_tiny_z_image(out)
    sizes = {
        "dim": 64,
        "n_layers": 2,
        "n_refiner_layers": 1,
        "n_heads": 2,
        "n_kv_heads": 2,
        "cap_feat_dim": 32,  # the tiny text encoder's width
        "axes_dims": [8, 12, 12],
        "axes_lens": [1024, 64, 64],
    }

    def pads(model):
        with torch.no_grad():
            model.x_pad_token.normal_(0, 0.5)
            model.cap_pad_token.normal_(0, 0.5)

    _published_denoiser(ZImageTransformer2DModel, checkpoint.denoiser, sizes, 1, out / "transformer", pads)
    _published_scheduler(checkpoint, out / "scheduler")
    _write_index(out, checkpoint)


def build_qwen_image(checkpoint, out: Path) -> None:
    """A tiny Qwen-Image folder (edit: with the Qwen2-VL processor): the tiny text encoder, tokenizer and VAE
    of ``make_tiny_qwen_image``; the denoiser, scheduler and ``model_index.json`` from the published config
    (sizes shrunk: 2 heads of 32, 2 layers)."""
    from diffusers import QwenImageTransformer2DModel

    from tools.make_tiny_qwen_image import TEXT_HIDDEN, build_tiny_qwen_image

    build_tiny_qwen_image(out, edit="processor" in checkpoint.components)
    sizes = {
        "num_layers": 2,
        "attention_head_dim": 32,
        "num_attention_heads": 2,
        "joint_attention_dim": TEXT_HIDDEN,
        "axes_dims_rope": [8, 12, 12],
    }
    _published_denoiser(QwenImageTransformer2DModel, checkpoint.denoiser, sizes, 1, out / "transformer")
    _published_scheduler(checkpoint, out / "scheduler")
    _write_index(out, checkpoint)


def build_flux(checkpoint, out: Path) -> None:
    """A tiny Flux folder: the tiny CLIP-L / T5 encoders, tokenizers and VAE of ``make_tiny_flux``; the denoiser,
    scheduler and ``model_index.json`` from the published config (sizes shrunk: 2 heads of 16, 2 double and 3
    single blocks)."""
    from diffusers import FluxTransformer2DModel

    from tools.make_tiny_flux import CLIP_HIDDEN, T5_HIDDEN, build_tiny_flux

    build_tiny_flux(out, "kontext" if checkpoint.pipeline == "FluxKontextPipeline" else "dev")
    sizes = {
        "num_layers": 2,
        "num_single_layers": 3,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": T5_HIDDEN,
        "pooled_projection_dim": CLIP_HIDDEN,
        "axes_dims_rope": [4, 6, 6],
    }
    _published_denoiser(FluxTransformer2DModel, checkpoint.denoiser, sizes, 1, out / "transformer")
    _published_scheduler(checkpoint, out / "scheduler")
    _write_index(out, checkpoint)


#: family name -> folder builder (a family joins with its builder here and its spec's PUBLISHED list)
BUILDERS = {"z_image": build_z_image, "qwen_image": build_qwen_image, "wan": build_wan, "flux": build_flux}


def family_of(checkpoint) -> str:
    """The family whose spec lists ``checkpoint``."""
    from vllm_omni.config.dit_families import family_specs

    for name, spec in family_specs().items():
        if checkpoint in spec.published:
            return name
    raise KeyError(f"{checkpoint.repo} is listed by no family spec")


def ensure_tiny_published(root: str | os.PathLike, checkpoint, family: str | None = None) -> Path:
    """Build (if missing or stale) and return ``root / "tiny-published" / <checkpoint name>``.

    The folder's stamp holds :data:`ASSET_VERSION` and a digest of the checkpoint record, so a changed
    published config rebuilds it. Safe to call from several processes at once (file lock, atomic rename).
    """
    from filelock import FileLock

    family = family or family_of(checkpoint)
    base = Path(root) / "tiny-published"
    base.mkdir(parents=True, exist_ok=True)
    final = base / checkpoint.name
    record = json.dumps([checkpoint.model_index(), checkpoint.scheduler, checkpoint.denoiser], sort_keys=True)
    version = f"{ASSET_VERSION}-{hashlib.sha256(record.encode()).hexdigest()[:16]}"
    with FileLock(str(base / f".{checkpoint.name}.lock")):
        stamp = final / ".asset_version"
        if not (stamp.is_file() and stamp.read_text().strip() == version):
            tmp = Path(tempfile.mkdtemp(prefix=f".{checkpoint.name}-", dir=base))
            try:
                BUILDERS[family](checkpoint, tmp / checkpoint.name)
                (tmp / checkpoint.name / ".asset_version").write_text(version + "\n")
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp / checkpoint.name, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def main() -> None:
    from vllm_omni.config.dit_families import family_specs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write tiny-published/<name>/ into")
    parser.add_argument("name", help="a published checkpoint name, e.g. Wan2.2-T2V-A14B-Diffusers")
    args = parser.parse_args()
    by_name = {c.name: c for spec in family_specs().values() for c in spec.published}
    print(ensure_tiny_published(args.out, by_name[args.name]))


if __name__ == "__main__":
    main()
