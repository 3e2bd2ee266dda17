"""Write tiny, randomly initialised Flux directories (FLUX.1-dev, FLUX.1-schnell, FLUX.1-Kontext-dev) for tests.

Each folder has the published checkpoint's layout and configuration with only the sizes shrunk:

* ``model_index.json`` as published (``FluxPipeline`` / ``FluxKontextPipeline``; ``image_encoder`` and
  ``feature_extractor`` stored as ``[null, null]``);
* ``transformer/``: ``FluxTransformer2DModel`` with the published ``patch_size`` 1, ``in_channels`` 64,
  ``guidance_embeds`` (true for dev and Kontext, false for schnell), 2 double + 3 single blocks, 2 heads of
  16 channels, ``axes_dims_rope`` (4, 6, 6), ``joint_attention_dim`` = the T5's 24, ``pooled_projection_dim``
  = the CLIP's 20; every norm weight drawn away from 1 (``1 + U(-0.5, 0.5)``);
* ``scheduler/``: the published ``FlowMatchEulerDiscreteScheduler`` configs (dev / Kontext: shift 3.0 with
  dynamic shifting between 256 and 4096 tokens, 0.5 -> 1.15; schnell: shift 1.0, no dynamic shifting);
* ``vae/``: ``AutoencoderKL`` with 16 latent channels, 8x compression, the published ``scaling_factor``
  0.3611 and ``shift_factor`` 0.1159, no quant convs (image sides: multiples of 16);
* ``text_encoder/`` + ``tokenizer/``: a 2-layer ``CLIPTextModel`` (hidden 20) and a byte-level BPE
  ``CLIPTokenizer`` (77 tokens); ``text_encoder_2/`` + ``tokenizer_2/``: a 2-layer ``T5EncoderModel``
  (gated GELU, d_model 24) and a unigram ``T5TokenizerFast``.

Every weight comes from a fixed seed (the three folders share the text encoders, VAE and every transformer
weight but the guidance embedder). Run as a script (``python tools/make_tiny_flux.py OUT_DIR``) or call
:func:`ensure_tiny_flux`; it builds under a file lock, in a temporary directory renamed into place.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

#: variant -> (folder name, pipeline class, guidance_embeds, scheduler config)
_DYNAMIC = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
VARIANTS: dict[str, tuple[str, str, bool, dict]] = {
    "dev": ("tiny-flux-dev", "FluxPipeline", True, _DYNAMIC),
    "schnell": (
        "tiny-flux-schnell",
        "FluxPipeline",
        False,
        {**_DYNAMIC, "shift": 1.0, "use_dynamic_shifting": False},
    ),
    "kontext": ("tiny-flux-kontext", "FluxKontextPipeline", True, _DYNAMIC),
}
FLUX_ASSET_VERSION = "1"
CLIP_HIDDEN, T5_HIDDEN = 20, 24


def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Draw every norm weight away from 1 and every norm bias away from 0 (fixed seed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "layer_norm" in name:
                noise = torch.rand(param.shape, generator=gen) - 0.5
                param.add_(noise if name.endswith("weight") else 0.1 * noise)


def _clip(out: Path) -> None:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from tools.make_tiny_diffusion import _bpe_vocab

    vocab, merges = _bpe_vocab(end_of_word="</w>")
    for tok in ("<|startoftext|>", "<|endoftext|>"):
        vocab[tok] = len(vocab)
    CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77).save_pretrained(out / "tokenizer")
    torch.manual_seed(10)
    config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=36,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=CLIP_HIDDEN,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    model = CLIPTextModel(config).eval()
    _perturb_norms(model, 11)
    model.save_pretrained(out / "text_encoder", safe_serialization=True)


def _t5(out: Path) -> None:
    from transformers import T5Config, T5EncoderModel

    from tools.make_tiny_wan import _tokenizer

    tokenizer = _tokenizer()
    tokenizer.save_pretrained(out / "tokenizer_2")
    torch.manual_seed(12)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=T5_HIDDEN,
        d_kv=8,
        d_ff=40,
        num_layers=2,
        num_heads=3,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    model = T5EncoderModel(config).eval()
    _perturb_norms(model, 13)
    model.save_pretrained(out / "text_encoder_2", safe_serialization=True)


def transformer_config(guidance_embeds: bool) -> dict:
    """The tiny ``FluxTransformer2DModel`` config (the published one with sizes shrunk)."""
    return dict(
        patch_size=1,
        in_channels=64,
        out_channels=None,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=T5_HIDDEN,
        pooled_projection_dim=CLIP_HIDDEN,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    )


def build_tiny_flux(out: Path, variant: str = "dev") -> None:
    """Write the tiny Flux folder of ``variant`` (``"dev"``, ``"schnell"``, ``"kontext"``) to ``out``
    (must not exist yet)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from tools.make_tiny_diffusion import _tiny_flux_style_vae

    _, class_name, guidance, scheduler = VARIANTS[variant]
    out.mkdir(parents=True)
    _clip(out)
    _t5(out)
    torch.manual_seed(1)
    transformer = FluxTransformer2DModel(**transformer_config(True))
    if not guidance:  # the same weights without the guidance embedder
        state = {k: v for k, v in transformer.state_dict().items() if "guidance_embedder" not in k}
        transformer = FluxTransformer2DModel(**transformer_config(False))
        transformer.load_state_dict(state)
    _perturb_norms(transformer, 2)
    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    _tiny_flux_style_vae(16, seed=3).save_pretrained(out / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**scheduler).save_pretrained(out / "scheduler")
    index = {
        "_class_name": class_name,
        "_diffusers_version": diffusers.__version__,
        "feature_extractor": [None, None],
        "image_encoder": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def ensure_tiny_flux(root: str | os.PathLike, variant: str = "dev") -> Path:
    """Build (if missing or stale) and return the tiny folder of ``variant`` under ``root``.

    Safe to call from several processes at once (file lock, temporary sibling renamed into place, a
    version stamp that triggers a rebuild after the layout changes).
    """
    from filelock import FileLock

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = VARIANTS[variant][0]
    final = root / name
    with FileLock(str(root / ".tiny_flux.lock")):
        stamp = final / ".asset_version"
        if not (stamp.is_file() and stamp.read_text().strip() == FLUX_ASSET_VERSION):
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            try:
                build_tiny_flux(tmp / "model", variant)
                (tmp / "model" / ".asset_version").write_text(FLUX_ASSET_VERSION + "\n")
                if final.exists():
                    shutil.rmtree(final)
                (tmp / "model").rename(final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


#: PEFT adapters for the tiny transformer: name -> (seed, targets). ``attn`` covers every layer kind of the
#: in-tree model (packed q/k/v of both streams and of the single blocks, row-parallel outputs, the single
#: blocks' ``proj_out`` and ``proj_mlp``, column-parallel modulation, replicated embedders); ``mlp`` touches
#: other layers only (the mixed-batch partner).
LORA_SPECS: dict[str, tuple[int, list[str]]] = {
    "attn": (
        21,
        ["to_q", "to_k", "add_v_proj", "to_out.0", "to_add_out", "proj_mlp", "norm1.linear", "x_embedder"],
    ),
    "mlp": (22, ["ff.net.0.proj", "ff_context.net.2", "norm.linear", "context_embedder"]),
}
LORA_RANK, LORA_ALPHA, LORA_STD = 4, 8.0, 0.3
LORA_ASSET_VERSION = "3"


def bfl_modules(dim: int, num_layers: int, num_single_layers: int) -> dict[str, tuple[int, int]]:
    """BFL's (original Flux) linear layer names -> ``(d_in, d_out)`` for the LoRA files users have:
    per double block the image / text stream's ``attn.qkv``, ``attn.proj``, ``mlp.0``, ``mlp.2``,
    ``mod.lin``; per single block the fused ``linear1`` (q, k, v and the MLP input), ``linear2`` and
    ``modulation.lin``."""
    out: dict[str, tuple[int, int]] = {}
    for i in range(num_layers):
        for s in ("img", "txt"):
            out[f"double_blocks.{i}.{s}_attn.qkv"] = (dim, 3 * dim)
            out[f"double_blocks.{i}.{s}_attn.proj"] = (dim, dim)
            out[f"double_blocks.{i}.{s}_mlp.0"] = (dim, 4 * dim)
            out[f"double_blocks.{i}.{s}_mlp.2"] = (4 * dim, dim)
            out[f"double_blocks.{i}.{s}_mod.lin"] = (dim, 6 * dim)
    for i in range(num_single_layers):
        out[f"single_blocks.{i}.linear1"] = (dim, 7 * dim)
        out[f"single_blocks.{i}.linear2"] = (5 * dim, dim)
        out[f"single_blocks.{i}.modulation.lin"] = (dim, 3 * dim)
    return out


def write_bfl_lora(
    path: Path, seed: int, layout: str, rank: int = 4, alpha: float = 6.0, linear1: bool = False
) -> Path:
    """A LoRA file on the BFL-named layers of the tiny transformer (``lora_down`` ~ N(0, 0.3),
    ``lora_up`` ~ N(0, 0.3), per-module ``.alpha``) in ``layout``: ``"kohya"`` (sd-scripts:
    ``lora_unet_double_blocks_0_img_attn_qkv``) or ``"comfyui"`` (``diffusion_model.double_blocks.0.img_attn.qkv``).

    The single blocks' fused ``linear1`` is left out unless ``linear1``: diffusers' converter splits it
    with FLUX.1's real sizes written in (3072 x 3 + 12288 rows), so at tiny sizes it refuses the file."""
    from safetensors.torch import save_file

    cfg = transformer_config(True)
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for module, (d_in, d_out) in bfl_modules(dim, cfg["num_layers"], cfg["num_single_layers"]).items():
        if module.endswith("linear1") and not linear1:
            continue
        name = "lora_unet_" + module.replace(".", "_") if layout == "kohya" else "diffusion_model." + module
        tensors[f"{name}.lora_down.weight"] = torch.randn(rank, d_in, generator=gen) * LORA_STD
        tensors[f"{name}.lora_up.weight"] = torch.randn(d_out, rank, generator=gen) * LORA_STD
        tensors[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(path))
    return path


def write_xlabs_lora(path: Path, seed: int, rank: int = 4) -> Path:
    """An XLabs-layout Flux LoRA file (``double_blocks.N.processor.{qkv,proj}_lora{1,2}.{down,up}.weight``:
    image stream 1, text stream 2; no alpha, so ``s = 1``) on the tiny transformer's double blocks."""
    from safetensors.torch import save_file

    cfg = transformer_config(True)
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_layers"]):
        for kind, d_out in (("qkv", 3 * dim), ("proj", dim)):
            for stream in (1, 2):
                name = f"double_blocks.{i}.processor.{kind}_lora{stream}"
                tensors[f"{name}.down.weight"] = torch.randn(rank, dim, generator=gen) * LORA_STD
                tensors[f"{name}.up.weight"] = torch.randn(d_out, rank, generator=gen) * LORA_STD
    save_file(tensors, str(path))
    return path


def ensure_tiny_flux_loras(model_dir: str | os.PathLike, root: str | os.PathLike) -> dict[str, Path]:
    """Build (if missing or stale) the tiny Flux adapters under ``root / "tiny-flux-loras"``.

    Returns ``{name: path}``: the PEFT folders of :data:`LORA_SPECS` (on the transformer of ``model_dir``)
    and the single files ``kohya`` / ``comfyui`` (:func:`write_bfl_lora`, BFL layer names) and ``xlabs``
    (:func:`write_xlabs_lora`).
    """
    from filelock import FileLock

    from tools.make_tiny_diffusion_lora import _build_adapter

    root = Path(root)
    final = root / "tiny-flux-loras"
    paths = {name: final / name for name in LORA_SPECS}
    paths.update({name: final / f"{name}.safetensors" for name in ("kohya", "comfyui", "xlabs")})
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".tiny_flux_loras.lock")):
        stamp = final / ".asset_version"
        if not (stamp.is_file() and stamp.read_text().strip() == LORA_ASSET_VERSION):
            tmp = Path(tempfile.mkdtemp(prefix=".tiny-flux-loras-", dir=root))
            try:
                for name, (seed, targets) in LORA_SPECS.items():
                    _build_adapter(
                        Path(model_dir) / "transformer", tmp / name, seed, LORA_RANK, LORA_ALPHA, targets,
                        "FluxTransformer2DModel", LORA_STD,
                    )  # fmt: skip
                write_bfl_lora(tmp / "kohya.safetensors", 23, "kohya")
                write_bfl_lora(tmp / "comfyui.safetensors", 24, "comfyui")
                write_xlabs_lora(tmp / "xlabs.safetensors", 25)
                (tmp / ".asset_version").write_text(LORA_ASSET_VERSION + "\n")
                if final.exists():
                    shutil.rmtree(final)
                tmp.rename(final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to hold the tiny Flux folders")
    parser.add_argument("--variant", choices=sorted(VARIANTS), action="append")
    args = parser.parse_args()
    for variant in args.variant or sorted(VARIANTS):
        print(ensure_tiny_flux(args.out, variant))


if __name__ == "__main__":
    main()
