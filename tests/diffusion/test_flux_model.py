"""The in-tree Flux denoiser against diffusers' FluxTransformer2DModel (same tiny weights, fp32)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
from vllm_omni.diffusion.models.flux import FluxTransformer2DModel
from vllm_omni.errors import ConfigError


@pytest.fixture(scope="module")
def folders():
    from tests.conftest import test_assets_root as _assets_root
    from tools.make_tiny_flux import ensure_tiny_flux

    init_diffusion_parallel_state(1, 0)
    return {v: ensure_tiny_flux(_assets_root(), v) / "transformer" for v in ("dev", "schnell")}


def _inputs(batch: int = 2, grid: tuple[int, int] = (2, 3), text: int = 7):
    g = torch.Generator().manual_seed(0)
    n = grid[0] * grid[1]
    ids = torch.zeros(n, 3)
    ids[:, 1], ids[:, 2] = torch.arange(n) // grid[1], torch.arange(n) % grid[1]
    return dict(
        hidden_states=torch.randn(batch, n, 64, generator=g),
        encoder_hidden_states=torch.randn(batch, text, 24, generator=g),
        pooled_projections=torch.randn(batch, 20, generator=g),
        timestep=torch.tensor([0.9, 0.3][:batch]),
        img_ids=ids,
        txt_ids=torch.zeros(text, 3),
    )


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_forward_matches_diffusers(folders, variant):
    from diffusers import FluxTransformer2DModel as Reference

    reference = Reference.from_pretrained(str(folders[variant])).eval()
    ours = FluxTransformer2DModel.from_pretrained(folders[variant])
    inputs = _inputs()
    guidance = torch.tensor([3.5, 1.0]) if variant == "dev" else None
    with torch.no_grad():
        expected = reference(**inputs, guidance=guidance, return_dict=False)[0]
        got = ours(**inputs, guidance=guidance)
    assert got.shape == expected.shape == (2, 6, 64)
    assert (got - expected).abs().max().item() <= 1e-5
    modules = dict(ours.named_modules())
    for name in ("transformer_blocks.0.attn.to_qkv", "transformer_blocks.1.attn.add_qkv"):
        assert isinstance(modules[name], QKVParallelLinear), name
    assert isinstance(modules["single_transformer_blocks.2.attn.to_qkv"], QKVParallelLinear)
    for name in ("transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.ff_context.net.2"):
        assert isinstance(modules[name], RowParallelLinear), name
    assert isinstance(modules["single_transformer_blocks.0.proj_out"], RowParallelLinear)
    for name in ("transformer_blocks.1.norm1.linear", "single_transformer_blocks.1.proj_mlp"):
        assert isinstance(modules[name], ColumnParallelLinear), name
    for name in ("x_embedder", "context_embedder", "proj_out", "norm_out.linear"):
        assert isinstance(modules[name], ReplicatedLinear), name
    assert ("time_text_embed.guidance_embedder.linear_1" in modules) == (variant == "dev")
    if variant == "dev":
        with pytest.raises(ValueError, match="pass guidance"):
            ours(**inputs)


def test_unknown_config_key_is_refused_by_name(folders, tmp_path):
    folder = tmp_path / "transformer"
    shutil.copytree(folders["dev"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "use_layer_norm_bias": True}))
    with pytest.raises(ConfigError, match=r"\['use_layer_norm_bias'\]"):
        FluxTransformer2DModel.from_pretrained(folder)


def test_a_variant_flux_does_not_serve_is_refused_at_start(folders, tmp_path):
    """The family spec's variant check: a folder whose transformer sets another patch_size is refused when
    the stage's config is built, naming the folder, the file, the key and the value."""
    from vllm_omni.config.diffusion import OmniDiffusionConfig

    source = folders["dev"].parent
    shutil.copy(source / "model_index.json", tmp_path / "model_index.json")
    for component in ("scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"):
        (tmp_path / component).symlink_to(source / component)
    shutil.copytree(source / "transformer", tmp_path / "transformer")
    config = json.loads((tmp_path / "transformer" / "config.json").read_text())
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({**config, "patch_size": 2}))
    with pytest.raises(ConfigError, match=r"transformer/config.json sets patch_size=2") as err:
        OmniDiffusionConfig(model=str(tmp_path))
    assert str(tmp_path) in str(err.value)
