"""Issue 35 rule 4: binding that explains itself and never silently does nothing (tiny Z-Image denoiser).

References: peft on diffusers' ``ZImageTransformer2DModel`` (the adapters are saved from it) and a hand
merge ``W + B A`` on a diffusers copy; fp32, tolerance 1e-5. Covered: both packed-mapping spellings (bare
and vLLM's dotted), ``target_modules`` naming a packed layer's sub-layer, unambiguous leaf keys, adapters
that bind nothing (folder, single file, custom loader) and refusals that name what the model offers;
every refusal leaves the cache and the served output unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

from vllm_omni.diffusion.lora import DiffusionLoRAManager
from vllm_omni.diffusion.lora.adapter import LoRAAdapterWeights
from vllm_omni.diffusion.lora.loading import load_lora_adapter
from vllm_omni.diffusion.lora.targets import TargetIndex
from vllm_omni.errors import ConfigError, LoRAFormatError
from vllm_omni.lora.request import LoRARequest

TOL = 1e-5


@pytest.fixture(scope="module")
def z(tiny_z_image_dir, tmp_path_factory):
    """diffusers reference, a factory of fresh in-tree denoisers, and peft adapters saved from the reference:
    ``q`` (r4, alpha 8, every ``to_q``) and ``qk`` (``to_q`` and ``to_k``)."""
    from diffusers import ZImageTransformer2DModel as Reference
    from peft import LoraConfig, get_peft_model

    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel

    folder = tiny_z_image_dir / "transformer"
    reference = Reference.from_pretrained(str(folder)).eval()
    adapters = {}
    for name, targets, seed in (("q", ["to_q"], 3), ("qk", ["to_q", "to_k"], 4)):
        model = get_peft_model(
            copy.deepcopy(reference), LoraConfig(r=4, lora_alpha=8.0, target_modules=targets)
        )
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        path = tmp_path_factory.mktemp(f"z_{name}")
        model.save_pretrained(str(path))
        adapters[name] = (str(path), model.eval())
    return {
        "reference": reference,
        "folder": folder,
        "ours": lambda: ZImageTransformer2DModel.from_pretrained(folder),
        "adapters": adapters,
        "root": tmp_path_factory.mktemp("z_files"),
    }


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 1, 4, 6, generator=g)], torch.tensor([0.4]), [torch.randn(7, 32, generator=g)]


@torch.no_grad()
def _served(manager, model, request, scale=1.0):
    manager.set_active_adapters([request], [scale])
    try:
        return model(*_inputs())[0]
    finally:
        manager.deactivate()


@torch.no_grad()
def _reference(model):
    return model(*_inputs(), return_dict=False)[0][0]


def _dotted(mapping):
    return [(f".{packed}", f".{sub}", shard) for packed, sub, shard in mapping]


def test_dotted_packed_mapping_gives_the_sub_layer_names_and_peft_values(z):
    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel

    class DottedZImage(ZImageTransformer2DModel):  # the same model, its mapping written vLLM's way
        stacked_params_mapping = _dotted(ZImageTransformer2DModel.stacked_params_mapping)

    ours = DottedZImage.from_pretrained(z["folder"])  # the weight loader reads the dotted form too
    bare = TargetIndex({"": ours}, ZImageTransformer2DModel.stacked_params_mapping)
    dotted = TargetIndex({"": ours}, ours.stacked_params_mapping)
    assert dotted.packed == bare.packed and "layers.0.attention.to_q" in dotted.packed
    with torch.no_grad():
        assert (ours(*_inputs())[0] - _reference(z["reference"])).abs().max().item() <= TOL
    manager = DiffusionLoRAManager(ours, max_loras=1, max_rank=4)
    path, peft_model = z["adapters"]["q"]
    got = _served(manager, ours, LoRARequest("q", 1, path))
    assert (got - _reference(peft_model)).abs().max().item() <= TOL
    assert (got - _reference(z["reference"])).abs().max().item() > 1e-3  # the adapter acts


def test_target_modules_naming_a_sub_layer_wraps_that_slice(z):
    ours = z["ours"]()
    manager = DiffusionLoRAManager(ours, max_loras=1, max_rank=4, target_modules=["to_q"])
    assert sorted(manager.wrappers) == [
        f"{block}.attention.to_qkv"
        for block in ("context_refiner.0", "layers.0", "layers.1", "noise_refiner.0")
    ]
    path, peft_model = z["adapters"]["q"]
    request = LoRARequest("q", 1, path)
    got = _served(manager, ours, request)
    assert (got - _reference(peft_model)).abs().max().item() <= TOL
    with pytest.raises(LoRAFormatError, match=r"4 of 8 modules match.*to_k") as info:
        manager.add_lora(LoRARequest("qk", 2, z["adapters"]["qk"][0]))
    assert "'to_k' (did you mean" not in str(info.value)
    assert manager.list_loras() == [1] and torch.equal(_served(manager, ours, request), got)
    with pytest.raises(ConfigError, match=r"target_modules 'to_qq' \(did you mean 'to_q'"):
        DiffusionLoRAManager(z["ours"](), target_modules=["to_qq"])


def _file(z, name, tensors):
    path = str(z["root"] / f"{name}.safetensors")
    save_file(tensors, path)
    return path


def test_an_unambiguous_leaf_key_resolves_and_an_ambiguous_one_is_named(z):
    ours = z["ours"]()
    manager = DiffusionLoRAManager(ours, max_loras=1, max_rank=4)
    g = torch.Generator().manual_seed(7)
    layer = ours.t_embedder.mlp[0].base_layer
    a = torch.randn(2, layer.weight.shape[1], generator=g) * 0.1
    b = torch.randn(layer.weight.shape[0], 2, generator=g) * 0.1
    leaf = _file(z, "leaf", {"mlp.0.lora_A.weight": a, "mlp.0.lora_B.weight": b})
    full = _file(z, "full", {"t_embedder.mlp.0.lora_A.weight": a, "t_embedder.mlp.0.lora_B.weight": b})
    got = _served(manager, ours, LoRARequest("leaf", 1, leaf))
    assert torch.equal(got, _served(manager, ours, LoRARequest("full", 2, full)))
    merged = copy.deepcopy(z["reference"])  # no alpha in the file: s = 1
    with torch.no_grad():
        merged.t_embedder.mlp[0].weight += b @ a
    assert (got - _reference(merged)).abs().max().item() <= TOL
    ambiguous = _file(
        z, "ambiguous", {"to_q.lora_A.weight": torch.zeros(2, 32), "to_q.lora_B.weight": torch.zeros(32, 2)}
    )
    before = manager.list_loras()
    with pytest.raises(
        LoRAFormatError, match=r"'to_q' fits 4 layers by its last components.*give the full name"
    ):
        manager.add_lora(LoRARequest("ambiguous", 3, ambiguous))
    assert manager.list_loras() == before


def test_refusals_name_the_nearest_modules_and_the_expected_prefix(z):
    ours = z["ours"]()
    manager = DiffusionLoRAManager(ours, max_loras=1, max_rank=4)
    a, b = torch.zeros(2, 32), torch.zeros(32, 2)
    wrapped = _file(
        z,
        "prefixed",
        {
            "model.diffusion.layers.0.attention.to_q.lora_A.weight": a,
            "model.diffusion.layers.0.attention.to_q.lora_B.weight": b,
        },
    )
    typo = _file(
        z, "typo", {"layers.0.attention.to_qq.lora_A.weight": a, "layers.0.attention.to_qq.lora_B.weight": b}
    )
    path = z["adapters"]["q"][0]
    served = _served(manager, ours, LoRARequest("q", 1, path))
    for bad, expected in (
        (
            wrapped,
            "ends with the model's 'layers.0.attention.to_q': the prefix 'model.diffusion.' is not one",
        ),
        (typo, "'layers.0.attention.to_qq': did you mean 'layers.0.attention.to_q'"),
    ):
        with pytest.raises(LoRAFormatError) as info:
            manager.add_lora(LoRARequest("bad", 9, bad))
        message = str(info.value)
        assert message.startswith(bad) and "none of its modules match" in message
        assert expected in message and "keys here start with 'layers.'" in message, message
    assert manager.list_loras() == [1]
    assert torch.equal(_served(manager, ours, LoRARequest("q", 1, path)), served)


def test_an_adapter_that_binds_nothing_is_refused_however_it_was_loaded(z):
    ours = z["ours"]()
    path = z["adapters"]["q"][0]
    empty = LoRAAdapterWeights(modules={}, source="custom-empty")
    manager = DiffusionLoRAManager(
        ours,
        max_loras=1,
        max_rank=4,
        adapter_loader=lambda p: empty if p == "custom" else load_lora_adapter(p),
    )
    served = _served(manager, ours, LoRARequest("q", 1, path))
    folder = z["root"] / "empty_peft"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": ["to_q"]}'
    )
    save_file({}, str(folder / "adapter_model.safetensors"))
    single = _file(z, "empty", {})
    for source, message in (
        (
            "custom",
            "custom-empty: the adapter has no LoRA modules, so it would bind no layer and change nothing",
        ),
        (str(folder), "holds no LoRA weights"),
        (single, "holds no LoRA weights"),
    ):
        with pytest.raises(LoRAFormatError, match=message):
            manager.add_lora(LoRARequest("empty", 5, source))
        assert manager.list_loras() == [1]
    assert torch.equal(_served(manager, ours, LoRARequest("q", 1, path)), served)
