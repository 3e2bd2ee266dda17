"""The manager on the in-tree Z-Image denoiser vs diffusers' ZImageTransformer2DModel wrapped by peft."""

from __future__ import annotations

import copy

import pytest
import torch

from vllm_omni.diffusion.lora import DiffusionLoRAManager
from vllm_omni.lora.request import LoRARequest

# peft full-match regex: block projections and the blocks' adaLN linear (the final layer's is `.1`)
TARGETS = r"(.*\.)?(to_q|to_k|to_v|to_out\.0|w1|w2|w3)|(layers|noise_refiner)\.\d+\.adaLN_modulation\.0"


@pytest.fixture(scope="module")
def z_models(tiny_z_image_dir, tmp_path_factory):
    from diffusers import ZImageTransformer2DModel as Reference
    from peft import LoraConfig, get_peft_model

    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel

    folder = tiny_z_image_dir / "transformer"
    reference = Reference.from_pretrained(str(folder)).eval()
    ours = ZImageTransformer2DModel.from_pretrained(folder)
    peft_models = {}
    for name, seed, r, alpha in (("a", 1, 4, 8.0), ("b", 2, 8, 4.0)):
        config = LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0)
        model = get_peft_model(copy.deepcopy(reference), config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        path = tmp_path_factory.mktemp(f"z_{name}")
        model.save_pretrained(str(path))
        peft_models[name] = (str(path), model.eval())
    return reference, ours, peft_models


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(16, 1, 4, 6, generator=g), torch.randn(16, 1, 4, 6, generator=g)]
    captions = [torch.randn(7, 32, generator=g), torch.randn(40, 32, generator=g)]
    return latents, torch.tensor([0.25, 0.8]), captions


@torch.no_grad()
def test_z_image_mixed_batch_matches_peft_on_diffusers(z_models):
    reference, ours, peft_models = z_models
    manager = DiffusionLoRAManager(ours, max_loras=2, max_rank=8)
    assert {"layers.0.attention.to_qkv", "layers.0.feed_forward.w13", "layers.0.adaLN_modulation.0"} <= set(
        manager.wrappers
    )
    (pa, a), (pb, _) = peft_models["a"], peft_models["b"]
    ra, rb = LoRARequest("a", 1, pa), LoRARequest("b", 2, pb)
    x, t, cap = _inputs()
    manager.set_active_adapters([[ra], [rb]], [[1.0], [0.5]])
    got = ours(x, t, cap)
    assert manager.wrappers["layers.0.adaLN_modulation.0"].slot_ranks(0) == (4,)
    assert manager.wrappers["noise_refiner.0.feed_forward.w13"].slot_ranks(1) == (8, 8)
    manager.deactivate()
    oracle_a = a(x[:1], t[:1], cap[:1], return_dict=False)[0][0]
    from peft.tuners.lora import LoraLayer

    b = copy.deepcopy(peft_models["b"][1])
    for module in b.modules():
        if isinstance(module, LoraLayer):
            module.set_scale("default", 0.5)
    oracle_b = b(x[1:], t[1:], cap[1:], return_dict=False)[0][0]
    errs = [(got[0] - oracle_a).abs().max().item(), (got[1] - oracle_b).abs().max().item()]
    print(f"Z-Image mixed batch vs peft+diffusers: {errs}")
    assert max(errs) <= 1e-5
    base = reference(x, t, cap, return_dict=False)[0]
    assert (got[0] - base[0]).abs().max().item() > 1e-3
