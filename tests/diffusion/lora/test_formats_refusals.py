"""Adapters that cannot be applied exactly are refused at load, naming the file and the offending keys,
and leave the manager's cache as it was (``list_loras()`` unchanged)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_formats import SPECS, make_z_peft

from tools import lora_layouts as layouts
from vllm_omni.diffusion.lora import DiffusionLoRAManager, fuse_lora_into_model
from vllm_omni.errors import LoRAFormatError
from vllm_omni.lora.request import LoRARequest

Q = "base_model.model.layers.0.attention.to_q"


@pytest.fixture(scope="module")
def z_refusal(tiny_z_image_dir, tmp_path_factory):
    from diffusers import ZImageTransformer2DModel as Reference

    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel

    folder = tiny_z_image_dir / "transformer"
    spec = dict(SPECS["pattern"])
    directory = str(tmp_path_factory.mktemp("z_refuse"))
    make_z_peft(Reference.from_pretrained(str(folder)), directory, spec.pop("seed"), **spec)
    model = ZImageTransformer2DModel.from_pretrained(folder)
    manager = DiffusionLoRAManager(model, max_loras=1, max_rank=8, max_cpu_loras=2)
    manager.add_lora(LoRARequest("good", 1, directory))
    return directory, manager, model


def _edit_file(path: str, out: str, change) -> str:
    tensors = load_file(path)
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out)
    return out


def _mismatch(tensors):
    a = "lora_unet_layers_0_feed_forward_w2.lora_down.weight"
    tensors[a] = torch.zeros(tensors[a].shape[0], 99)


def _variants(directory: str, tmp: str) -> dict[str, tuple[str, str]]:
    """name -> (path, regex the message must match)."""
    kohya = layouts.write_kohya(directory, f"{tmp}/kohya.safetensors")
    edit = layouts.edit_peft
    return {
        "use_dora_flag": (edit(directory, f"{tmp}/dora_flag", config_update={"use_dora": True}), "use_dora"),
        "dora_magnitude_without_flag": (
            edit(directory, f"{tmp}/dora_mag", tensors_update={f"{Q}.lora_magnitude_vector": torch.ones(64)}),
            r"DoRA.*lora_magnitude_vector",
        ),
        "kohya_dora_scale": (
            _edit_file(
                kohya,
                f"{tmp}/kohya_dora.safetensors",
                lambda t: t.update({"lora_unet_layers_0_attention_to_q.dora_scale": torch.ones(1, 64)}),
            ),
            r"kohya_dora\.safetensors.*DoRA.*dora_scale",
        ),
        "modules_to_save_weights": (
            edit(
                directory,
                f"{tmp}/mts",
                tensors_update={
                    "base_model.model.t_embedder.mlp.0.modules_to_save.default.weight": torch.ones(4, 4)
                },
            ),
            r"modules_to_save.*t_embedder",
        ),
        "lora_bias_tensor": (
            edit(directory, f"{tmp}/bias_t", tensors_update={f"{Q}.lora_B.bias": torch.zeros(64)}),
            r"LoRA bias.*to_q\.lora_B\.bias",
        ),
        "bias_all_config": (edit(directory, f"{tmp}/bias_cfg", config_update={"bias": "all"}), "bias='all'"),
        "int8_kohya": (
            _edit_file(
                kohya,
                f"{tmp}/int8.safetensors",
                lambda t: t.update({k: v.to(torch.int8) for k, v in t.items() if "lora_down" in k}),
            ),
            r"int8\.safetensors.*quantised.*torch\.int8.*lora_down",
        ),
        "missing_lora_alpha": (
            edit(directory, f"{tmp}/no_alpha", config_remove=("lora_alpha",)),
            "no lora_alpha",
        ),
        "config_rank_disagrees": (
            edit(directory, f"{tmp}/rank", config_update={"r": 5}),
            r"stores rank 4 but the config declares rank 5",
        ),
        "alpha_zero": (
            _edit_file(
                kohya,
                f"{tmp}/alpha0.safetensors",
                lambda t: t.update({"lora_unet_layers_0_feed_forward_w1.alpha": torch.tensor(0.0)}),
            ),
            r"alpha 0\.0.*zero",
        ),
        "tensors_outside_target_modules": (
            edit(directory, f"{tmp}/untargeted", config_update={"target_modules": r".*\.(to_q|to_k|to_v)"}),
            r"target_modules does not select.*feed_forward",
        ),
        "shape_for_another_model": (
            _edit_file(kohya, f"{tmp}/shape.safetensors", _mismatch),
            r"shape\.safetensors.*feed_forward.w2.*\(6, 99\).*\(6, \d+\)",
        ),
        "text_encoder_keys": (  # a bare manager patches its denoiser only: a text-encoder part is refused, not dropped
            _edit_file(
                kohya,
                f"{tmp}/te.safetensors",
                lambda t: t.update(
                    {
                        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(2, 8),
                        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(8, 2),
                        "lora_te1_text_model_encoder_layers_0_mlp_fc1.alpha": torch.tensor(1.0),
                    }
                ),
            ),
            r"text-encoder parts.*denoiser only.*lora_te1_.*text_model_encoder_layers_0_mlp_fc1",
        ),
        "unknown_module": (
            _edit_file(
                kohya,
                f"{tmp}/unknown.safetensors",
                lambda t: t.update(
                    {
                        "lora_unet_layers_0_attention_to_z.lora_down.weight": torch.zeros(2, 64),
                        "lora_unet_layers_0_attention_to_z.lora_up.weight": torch.zeros(64, 2),
                    }
                ),
            ),
            r"unknown\.safetensors.*unmatched.*to.z",
        ),
        "incomplete_lokr": (  # LoKr is served (test_lycoris.py); a module without its w2 factor is not
            _edit_file(
                kohya,
                f"{tmp}/lokr.safetensors",
                lambda t: t.update({"lora_unet_layers_0_attention_to_q.lokr_w1": torch.zeros(2, 2)}),
            ),
            r"lokr\.safetensors.*to_q.*needs 2-D lokr_w2 or both lokr_w2_a and lokr_w2_b, got \['lokr_w1'\]",
        ),
    }


@pytest.fixture(scope="module")
def variants(z_refusal, tmp_path_factory):
    return _variants(z_refusal[0], str(tmp_path_factory.mktemp("variants")))


@pytest.mark.parametrize(
    "name",
    [
        "use_dora_flag",
        "dora_magnitude_without_flag",
        "kohya_dora_scale",
        "modules_to_save_weights",
        "lora_bias_tensor",
        "bias_all_config",
        "int8_kohya",
        "missing_lora_alpha",
        "config_rank_disagrees",
        "alpha_zero",
        "tensors_outside_target_modules",
        "shape_for_another_model",
        "text_encoder_keys",
        "unknown_module",
        "incomplete_lokr",
    ],
)
def test_refused_and_nothing_registered(z_refusal, variants, name):
    _, manager, _ = z_refusal
    path, pattern = variants[name]
    before = manager.list_loras()
    with pytest.raises(LoRAFormatError, match=pattern) as info:
        manager.add_lora(LoRARequest(name, 50, path))
    print(f"{name}: {info.value}")
    assert manager.list_loras() == before == [1]
    assert manager.slot_assignment() == {} or 50 not in manager.slot_assignment()


def test_fuse_refuses_the_same_and_changes_nothing(z_refusal, variants, tiny_z_image_dir):
    from vllm_omni.diffusion.distributed.parallel_state import current_vllm_config_for_layers
    from vllm_omni.diffusion.models.weight_loading import iter_safetensors
    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel

    folder = tiny_z_image_dir / "transformer"
    config = json.loads((folder / "config.json").read_text())
    with current_vllm_config_for_layers():
        fresh = ZImageTransformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    fresh.load_weights(iter_safetensors(folder))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    for name in (
        "kohya_dora_scale",
        "int8_kohya",
        "shape_for_another_model",
        "missing_lora_alpha",
        "alpha_zero",
    ):
        path, pattern = variants[name]
        with pytest.raises(LoRAFormatError, match=pattern):
            fuse_lora_into_model(fresh, path)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
