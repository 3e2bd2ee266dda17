"""The in-tree Wan denoiser against diffusers' ``WanTransformer3DModel`` on the same weights (float32).

Checkpoints: the text-to-video ``transformer`` of ``tools/make_tiny_wan.py`` (2 layers, 2 heads of 8)
and a tiny image-to-video variant (image cross-attention: ``image_dim``, ``added_kv_proj_dim``) saved
by diffusers here, both read back from disk with their real key names.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from tests.conftest import test_assets_root
from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state
from vllm_omni.diffusion.models.wan import WanTransformer3DModel
from vllm_omni.errors import ConfigError

TOL = 2e-5


@pytest.fixture(scope="module")
def wan_dir() -> Path:
    from tools.make_tiny_wan import ensure_tiny_wan

    return ensure_tiny_wan(test_assets_root())


@pytest.fixture(scope="module")
def t2v(wan_dir):
    from diffusers import WanTransformer3DModel as Reference

    init_diffusion_parallel_state(1, 0)
    folder = wan_dir / "transformer"
    return Reference.from_pretrained(str(folder)).eval(), WanTransformer3DModel.from_pretrained(folder)


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    from diffusers import WanTransformer3DModel as Reference

    init_diffusion_parallel_state(1, 0)
    torch.manual_seed(7)
    reference = Reference(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=36,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=48,
        num_layers=2,
        image_dim=20,
        added_kv_proj_dim=24,
        rope_max_seq_len=32,
    ).eval()
    folder = tmp_path_factory.mktemp("wan_i2v") / "transformer"
    reference.save_pretrained(folder, safe_serialization=True)
    return reference, WanTransformer3DModel.from_pretrained(folder)


def _inputs(channels: int, text_len: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, channels, 3, 4, 6, generator=g)
    text = torch.randn(2, text_len, 32, generator=g)
    return latents, torch.tensor([999.0, 312.5]), text


def test_text_to_video_forward_matches_diffusers(t2v):
    reference, ours = t2v
    x, t, text = _inputs(16, text_len=20)
    with torch.no_grad():
        expected = reference(x, t, text, return_dict=False)[0]
        got = ours(x, t, text)
        # Wan2.2 TI2V's per-token timesteps (B, F'*H'*W'), different per token
        per_token = torch.linspace(10.0, 990.0, 3 * 2 * 3).expand(2, -1)
        expected_tokens = reference(x, per_token, text, return_dict=False)[0]
        got_tokens = ours(x, per_token, text)
    assert got.shape == expected.shape == (2, 16, 3, 4, 6)
    assert (got - expected).abs().max().item() <= TOL
    assert (got_tokens - expected_tokens).abs().max().item() <= TOL
    assert (expected_tokens - expected).abs().max().item() > 1e-3  # the per-token path is exercised


def test_image_to_video_forward_matches_diffusers(i2v):
    """Image cross-attention (``add_k_proj`` / ``add_v_proj`` / ``norm_added_k``): diffusers splits the
    text off the last 512 context tokens, so the text here is 512 tokens long."""
    reference, ours = i2v
    x, t, text = _inputs(36)
    image = torch.randn(2, 5, 20, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
        got = ours(x, t, text, image)
    assert got.shape == expected.shape == (2, 16, 3, 4, 6)
    assert (got - expected).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="needs image embeddings"):
        ours(x, t, text)


def test_layers_are_vllm_parallel_layers_with_packed_qkv(t2v):
    reference, ours = t2v
    modules = dict(ours.named_modules())
    assert ours.stacked_params_mapping == [
        ("to_qkv", "to_q", "q"),
        ("to_qkv", "to_k", "k"),
        ("to_qkv", "to_v", "v"),
    ]
    assert isinstance(modules["blocks.0.attn1.to_qkv"], QKVParallelLinear)
    for name in ("blocks.1.attn2.to_q", "blocks.1.attn2.to_k", "blocks.0.ffn.net.0.proj"):
        assert isinstance(modules[name], ColumnParallelLinear), name
    for name in ("blocks.0.attn1.to_out.0", "blocks.0.attn2.to_out.0", "blocks.1.ffn.net.2"):
        assert isinstance(modules[name], RowParallelLinear), name
    for name in ("condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1", "proj_out"):
        assert isinstance(modules[name], ReplicatedLinear), name
    ref = dict(reference.named_parameters())
    packed = dict(ours.named_parameters())["blocks.1.attn1.to_qkv.weight"]
    expected = torch.cat([ref[f"blocks.1.attn1.to_{p}.weight"] for p in "qkv"])
    torch.testing.assert_close(packed, expected, rtol=0, atol=0)


def test_bad_checkpoint_and_sizes_name_the_culprit(t2v, wan_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, ours = t2v
    x, t, text = _inputs(16, text_len=4)
    with pytest.raises(ValueError, match=r"not a multiple of the patch"):
        ours(x[:, :, :, :3], t, text)
    with pytest.raises(ValueError, match=r"exceeds the rotary table of 32"):
        ours(torch.zeros(1, 16, 33, 2, 2), t[:1], text[:1])
    folder = tmp_path / "transformer"
    shutil.copytree(wan_dir / "transformer", folder)
    [weights] = folder.glob("*.safetensors")
    tensors = load_file(str(weights))
    tensors["blocks.0.attn1.to_q_extra.weight"] = tensors.pop("blocks.0.attn1.to_q.weight")
    save_file(tensors, str(weights))
    with pytest.raises(ConfigError, match=r"blocks\.0\.attn1\.to_q_extra\.weight"):
        WanTransformer3DModel.from_pretrained(folder)


@pytest.mark.parametrize(
    ("kind", "config"),
    [
        ("loha", {"r": 4, "alpha": 6.0}),
        ("lokr", {"r": 2, "alpha": 3.0, "decompose_both": True, "decompose_factor": 4}),
    ],
)
def test_loha_and_lokr_adapters_match_peft(t2v, wan_dir, tmp_path, kind, config):
    """LyCORIS adapters (peft's LoHa / LoKr) on the packed q/k/v, cross-attention and FFN layers of the
    in-tree denoiser (``DiffusionLoRAManager``) equal peft's own forward on diffusers' model, at scale 0.7."""
    import peft
    from peft.tuners.lycoris_utils import LycorisLayer

    from vllm_omni.diffusion.lora import DiffusionLoRAManager
    from vllm_omni.lora.request import LoRARequest

    reference = t2v[0]
    ours = WanTransformer3DModel.from_pretrained(wan_dir / "transformer")  # patched here alone
    cls = {"loha": peft.LoHaConfig, "lokr": peft.LoKrConfig}[kind]
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    model = peft.get_peft_model(copy.deepcopy(reference), cls(target_modules=targets, **config))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "hada_" in name or "lokr_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(str(tmp_path / kind))
    for module in model.modules():
        if isinstance(module, LycorisLayer):
            module.set_scale("default", 0.7)
    manager = DiffusionLoRAManager(ours, max_loras=1, max_rank=16)
    request = LoRARequest(kind, 1, str(tmp_path / kind))
    x, t, text = _inputs(16, text_len=20)
    try:
        manager.set_active_adapters([request], [0.7])
        with torch.no_grad():
            got = ours(x, t, text)
            want = model(x, t, text, return_dict=False)[0]
            base = reference(x, t, text, return_dict=False)[0]
    finally:
        manager.deactivate()
    assert (want - base).abs().max().item() > 1e-2
    assert (got - want).abs().max().item() <= TOL
