"""The in-tree Z-Image denoiser against diffusers' ZImageTransformer2DModel."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel


@pytest.fixture(scope="module")
def models(tiny_z_image_dir):
    from diffusers import ZImageTransformer2DModel as Reference

    init_diffusion_parallel_state(1, 0)
    folder = tiny_z_image_dir / "transformer"
    return Reference.from_pretrained(str(folder)).eval(), ZImageTransformer2DModel.from_pretrained(folder)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(16, 1, 4, 6, generator=g), torch.randn(16, 1, 4, 6, generator=g)]
    captions = [torch.randn(7, 32, generator=g), torch.randn(40, 32, generator=g)]  # ragged: masks on
    return latents, torch.tensor([0.25, 0.8]), captions


def test_forward_matches_diffusers(models):
    reference, ours = models
    x, t, cap = _inputs()
    with torch.no_grad():
        expected = reference(x, t, cap, return_dict=False)[0]
        got = ours(x, t, cap)
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape == (16, 1, 4, 6)
        assert (g - e).abs().max().item() <= 1e-5


def test_stacked_params_mapping_and_layer_types(models):
    _, ours = models
    assert ours.stacked_params_mapping == [
        ("to_qkv", "to_q", "q"),
        ("to_qkv", "to_k", "k"),
        ("to_qkv", "to_v", "v"),
        ("w13", "w1", 0),
        ("w13", "w3", 1),
    ]
    modules = dict(ours.named_modules())
    assert isinstance(modules["layers.0.attention.to_qkv"], QKVParallelLinear)
    assert isinstance(modules["layers.1.attention.to_out.0"], RowParallelLinear)
    assert isinstance(modules["noise_refiner.0.feed_forward.w13"], MergedColumnParallelLinear)
    assert isinstance(modules["context_refiner.0.feed_forward.w2"], RowParallelLinear)
    for name in ("all_x_embedder.2-1", "cap_embedder.1", "t_embedder.mlp.0", "layers.0.adaLN_modulation.0"):
        assert isinstance(modules[name], ReplicatedLinear), name
    assert isinstance(modules["all_final_layer.2-1.adaLN_modulation.1"], ReplicatedLinear)
    # Base weights stay dense in layer.weight (keep_base_weights=True default).
    qkv = modules["layers.0.attention.to_qkv"]
    assert qkv.weight.shape == (3 * 64, 64)


def test_packed_weight_equals_checkpoint(models):
    reference, ours = models
    ref = dict(reference.named_parameters())
    qkv = dict(ours.named_parameters())["layers.1.attention.to_qkv.weight"]
    expected = torch.cat([ref[f"layers.1.attention.to_{p}.weight"] for p in "qkv"])
    torch.testing.assert_close(qkv, expected, rtol=0, atol=0)
    w13 = dict(ours.named_parameters())["layers.0.feed_forward.w13.weight"]
    expected = torch.cat([ref["layers.0.feed_forward.w1.weight"], ref["layers.0.feed_forward.w3.weight"]])
    torch.testing.assert_close(w13, expected, rtol=0, atol=0)


def test_sharded_checkpoint_and_packed_weights_loading(models, tiny_z_image_dir, tmp_path):
    reference, ours = models
    reference.save_pretrained(tmp_path, max_shard_size="100KB", safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors.index.json")), "expected a sharded checkpoint"
    sharded = ZImageTransformer2DModel.from_pretrained(tmp_path, keep_base_weights=False)
    # keep_base_weights=False: vLLM's CPU repacking may empty layer.weight; outputs still agree.
    x, t, cap = _inputs(1)
    with torch.no_grad():
        for a, b in zip(ours(x, t, cap), sharded(x, t, cap), strict=True):
            assert (a - b).abs().max().item() <= 1e-5


def test_strict_loading_reports_unexpected_and_missing(tiny_z_image_dir, tmp_path):
    init_diffusion_parallel_state(1, 0)
    folder = tmp_path / "transformer"
    shutil.copytree(tiny_z_image_dir / "transformer", folder)
    config = json.loads((folder / "config.json").read_text())
    config["n_layers"] = 3  # checkpoint has only 2 layers
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"parameters without weights \['layers\.2\."):
        ZImageTransformer2DModel.from_pretrained(folder)
