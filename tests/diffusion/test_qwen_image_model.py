"""The in-tree Qwen-Image denoiser against diffusers' QwenImageTransformer2DModel (same tiny weights, fp32)."""

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
from vllm_omni.diffusion.models.qwen_image import QwenImageTransformer2DModel
from vllm_omni.errors import ConfigError

SHAPES = [[(1, 2, 3)]]  # one 32x48 image: 2x3 patches of the 4x6 latent


@pytest.fixture(scope="module")
def models(tiny_qwen_image_dir):
    from diffusers import QwenImageTransformer2DModel as Reference

    init_diffusion_parallel_state(1, 0)
    folder = tiny_qwen_image_dir / "transformer"
    return Reference.from_pretrained(str(folder)).eval(), QwenImageTransformer2DModel.from_pretrained(folder)


def _inputs(seed: int = 0, batch: int = 2, text: int = 9):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 6, 64, generator=g)
    txt = torch.randn(batch, text, 32, generator=g)
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[0, 5:] = 0  # ragged: sample 0 has 5 real tokens, the rest is padding
    return latents, txt, mask, torch.tensor([0.9, 0.3][:batch])


@pytest.mark.parametrize("shapes", [SHAPES, [[(1, 2, 3), (1, 2, 3)]]], ids=["t2i", "two-images"])
def test_forward_matches_diffusers(models, shapes):
    reference, ours = models
    x, txt, mask, t = _inputs()
    if len(shapes[0]) == 2:  # an edit-style sample: target and condition image tokens concatenated
        x = torch.cat([x, torch.randn_like(x)], dim=1)
    with torch.no_grad():
        expected = reference(
            hidden_states=x,
            encoder_hidden_states=txt,
            encoder_hidden_states_mask=mask,
            timestep=t,
            img_shapes=shapes * 2,
            return_dict=False,
        )[0]
        got = ours(x, txt, mask, t, shapes * 2)
    assert got.shape == expected.shape == (2, x.shape[1], 64)
    assert (got - expected).abs().max().item() <= 1e-5


def test_layers_and_packed_weights(models):
    reference, ours = models
    modules = dict(ours.named_modules())
    assert isinstance(modules["transformer_blocks.0.attn.to_qkv"], QKVParallelLinear)
    assert isinstance(modules["transformer_blocks.1.attn.add_qkv"], QKVParallelLinear)
    for name in ("attn.to_out.0", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.2"):
        assert isinstance(modules[f"transformer_blocks.0.{name}"], RowParallelLinear), name
    for name in ("img_mlp.net.0.proj", "txt_mlp.net.0.proj", "img_mod.1", "txt_mod.1"):
        assert isinstance(modules[f"transformer_blocks.1.{name}"], ColumnParallelLinear), name
    for name in (
        "img_in",
        "txt_in",
        "proj_out",
        "norm_out.linear",
        "time_text_embed.timestep_embedder.linear_1",
    ):
        assert isinstance(modules[name], ReplicatedLinear), name
    ref = dict(reference.named_parameters())
    ours_params = dict(ours.named_parameters())
    for packed, subs in (
        ("to_qkv", ("to_q", "to_k", "to_v")),
        ("add_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")),
    ):
        for kind in ("weight", "bias"):
            expected = torch.cat([ref[f"transformer_blocks.1.attn.{s}.{kind}"] for s in subs])
            torch.testing.assert_close(
                ours_params[f"transformer_blocks.1.attn.{packed}.{kind}"], expected, rtol=0, atol=0
            )


def test_sharded_checkpoint_loads_the_same(models, tmp_path):
    reference, ours = models
    reference.save_pretrained(tmp_path, max_shard_size="300KB", safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors.index.json")), "expected a sharded checkpoint"
    sharded = QwenImageTransformer2DModel.from_pretrained(tmp_path, keep_base_weights=False)
    x, txt, _, t = _inputs(1)
    with torch.no_grad():
        assert (ours(x, txt, None, t, SHAPES * 2) - sharded(x, txt, None, t, SHAPES * 2)).abs().max() <= 1e-6


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("num_layers", 3, r"parameters without weights \['transformer_blocks\.2\."),
        ("zero_cond_t", True, "zero_cond_t"),
    ],
)
def test_bad_checkpoints_are_refused_by_name(tiny_qwen_image_dir, tmp_path, key, value, match):
    init_diffusion_parallel_state(1, 0)
    folder = tmp_path / "transformer"
    shutil.copytree(tiny_qwen_image_dir / "transformer", folder)
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):
        QwenImageTransformer2DModel.from_pretrained(folder)
