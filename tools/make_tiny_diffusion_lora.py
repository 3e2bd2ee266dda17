"""Write deterministic PEFT LoRA adapters for the tiny Z-Image transformer (test assets).

The adapters are made the way users make them: diffusers' ``ZImageTransformer2DModel`` from
the tiny directory's ``transformer/`` folder, wrapped by ``peft.get_peft_model`` with a
``LoraConfig``, then ``save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``).
Every ``lora_A`` / ``lora_B`` is overwritten with seeded normal values (``lora_B`` non-zero,
so each adapter changes the output).

Adapters (name: rank, alpha, target modules):

* ``attn``: r 4, alpha 8, ``to_q``, ``to_k``, ``to_v``, ``to_out.0`` (fills all of the packed ``to_qkv``);
* ``qv``: r 2, alpha 4, ``to_q``, ``to_v`` only (the k slice of ``to_qkv`` stays zero);
* ``ff``: r 8, alpha 4, ``w1``, ``w3`` (both halves of the packed ``w13``);
* ``embed``: r 4, alpha 4, the patch and caption embedders (run on ragged, concatenated tokens)
  and the blocks' ``adaLN_modulation.0``;
* ``attn.safetensors``: ``attn`` as one diffusers-style file (keys without ``base_model.model.``,
  ``lora_adapter_metadata`` header with ``r`` / ``lora_alpha``), for the distill backend.

Run ``python tools/make_tiny_diffusion_lora.py Z_IMAGE_DIR OUT_DIR`` or call
:func:`ensure_tiny_z_image_loras` (file-locked, built once, rebuilt when ``ASSET_VERSION`` changes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

ASSET_VERSION = "2"
LORA_STD = 0.08

#: name -> (seed, r, lora_alpha, target_modules (suffix list or full-match regex))
ADAPTERS: dict[str, tuple[int, int, float, list[str] | str]] = {
    "attn": (101, 4, 8.0, ["to_q", "to_k", "to_v", "to_out.0"]),
    "qv": (102, 2, 4.0, ["to_q", "to_v"]),
    "ff": (103, 8, 4.0, ["w1", "w3"]),
    # a regex (peft full-matches it): the final layer's `adaLN_modulation.0` is a SiLU, not a Linear
    "embed": (
        104,
        4,
        4.0,
        r"all_x_embedder\.2-1|cap_embedder\.1|(layers|noise_refiner)\.\d+\.adaLN_modulation\.0",
    ),
}


def adapter_config_metadata(adapter_dir: str | os.PathLike) -> dict:
    """The ``adapter_config.json`` fields diffusers needs as ``metadata`` (``r``, ``lora_alpha``, ...)."""
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    keys = ("r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern", "bias")
    return {k: cfg[k] for k in keys if k in cfg and cfg[k] is not None}


def _build_adapter(
    transformer_dir: Path,
    out: Path,
    seed: int,
    r: int,
    alpha: float,
    targets: list[str] | str,
    model_class: str = "ZImageTransformer2DModel",
    std: float = LORA_STD,
):
    """A PEFT LoRA folder on ``targets`` of the diffusers ``model_class`` in ``transformer_dir``, weights
    ~ N(0, ``std``) from ``seed``."""
    import diffusers
    from peft import LoraConfig, get_peft_model

    base = getattr(diffusers, model_class).from_pretrained(str(transformer_dir)).eval()
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(str(out))
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = None  # independent of where the tiny model lives
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    readme = out / "README.md"
    if readme.exists():
        readme.unlink()


def build_lycoris_adapter(
    transformer_dir: str | os.PathLike,
    out: str | os.PathLike,
    kind: str,
    seed: int,
    targets: list[str] | str,
    std: float = 0.3,
    *,
    model_class: str = "ZImageTransformer2DModel",
    **config,
) -> Path:
    """A peft LoHa (``kind="loha"``) or LoKr (``"lokr"``) directory on the tiny transformer (the diffusers
    ``model_class``, Z-Image by default).

    ``config`` goes to peft's ``LoHaConfig`` / ``LoKrConfig`` (``r``, ``alpha``, ``decompose_both`` ...);
    every ``hada_*`` / ``lokr_*`` factor is overwritten with seeded normal values of ``std``. Not part of
    the shared assets: tests write these into their own temporary directories.
    """
    import diffusers
    import peft

    cls = {"loha": peft.LoHaConfig, "lokr": peft.LoKrConfig}[kind]
    base = getattr(diffusers, model_class).from_pretrained(str(transformer_dir)).eval()
    model = peft.get_peft_model(base, cls(target_modules=targets, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "hada_" in name or "lokr_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(str(out))
    cfg_path = Path(out) / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = None
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (Path(out) / "README.md").unlink(missing_ok=True)
    return Path(out)


def _write_single_file(adapter_dir: Path, out_file: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    tensors = {k.removeprefix("base_model.model."): v.contiguous() for k, v in tensors.items()}
    meta = adapter_config_metadata(adapter_dir)
    save_file(tensors, str(out_file), metadata={"lora_adapter_metadata": json.dumps(meta, sort_keys=True)})


def build_tiny_z_image_loras(z_image_dir: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write every adapter of :data:`ADAPTERS` (and ``attn.safetensors``) into ``out`` (must not exist)."""
    out = Path(out)
    out.mkdir(parents=True)
    transformer_dir = Path(z_image_dir) / "transformer"
    for name, (seed, r, alpha, targets) in ADAPTERS.items():
        _build_adapter(transformer_dir, out / name, seed, r, alpha, targets)
    _write_single_file(out / "attn", out / "attn.safetensors")


def ensure_tiny_z_image_loras(z_image_dir: str | os.PathLike, root: str | os.PathLike) -> dict[str, Path]:
    """Build (if missing) and return ``{"attn", "qv", "ff", "embed": PEFT dir, "attn_file": .safetensors}``.

    Written under ``root/tiny-z-image-loras`` in a temporary sibling renamed into place, under a
    file lock, so concurrent test processes are safe.
    """
    from filelock import FileLock

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / "tiny-z-image-loras"
    with FileLock(str(root / ".tiny_z_image_loras.lock")):
        stamp = final / ".asset_version"
        if not (stamp.is_file() and stamp.read_text().strip() == ASSET_VERSION):
            tmp = Path(tempfile.mkdtemp(prefix=".tiny-z-image-loras-", dir=root))
            try:
                build_tiny_z_image_loras(z_image_dir, tmp / "out")
                (tmp / "out" / ".asset_version").write_text(ASSET_VERSION + "\n")
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp / "out", final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    paths = {name: final / name for name in ADAPTERS}
    paths["attn_file"] = final / "attn.safetensors"
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("z_image_dir", help="tiny Z-Image directory (tools/make_tiny_diffusion.py)")
    parser.add_argument("out", help="directory to write tiny-z-image-loras/ into")
    args = parser.parse_args()
    for key, path in ensure_tiny_z_image_loras(args.z_image_dir, args.out).items():
        print(f"{key}: {path}")


if __name__ == "__main__":
    main()
