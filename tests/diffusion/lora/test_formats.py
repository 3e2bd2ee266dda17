"""Every accepted adapter layout applies exactly: each file is the same PEFT adapter with renamed keys
(tools/lora_layouts.py), loaded into the manager on the in-tree tiny Z-Image denoiser (vLLM layers) and
compared with peft on diffusers' ZImageTransformer2DModel (the oracle)."""

from __future__ import annotations

import copy
import logging
import time

import pytest
import torch
from lora_toy_models import inputs, make_vllm_dit, save_peft_adapter

from tools import lora_layouts as layouts
from vllm_omni.diffusion.lora import DiffusionLoRAManager, fuse_lora_into_model, load_lora_adapter
from vllm_omni.lora.request import LoRARequest

# peft full-match regex: block projections and the blocks' adaLN linear (the final layer's is `.1`)
TARGETS = r"(.*\.)?(to_q|to_k|to_v|to_out\.0|w1|w2|w3)|(layers|noise_refiner)\.\d+\.adaLN_modulation\.0"
LIST_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
SPECS = {
    # per-module ranks and alphas: every layout must carry them as per-module scaling
    "pattern": dict(
        seed=1,
        r=4,
        lora_alpha=8.0,
        target_modules=TARGETS,
        rank_pattern={"to_k": 2, "w2": 6},
        alpha_pattern={"to_v": 3.0, r"layers\.1\.adaLN_modulation\.0": 1.0},
    ),
    "rslora": dict(seed=2, r=8, lora_alpha=6.0, target_modules=LIST_TARGETS, use_rslora=True),
}


def make_z_peft(reference, path: str, seed: int, **config_kwargs):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(reference), LoraConfig(lora_dropout=0.0, **config_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(path)
    return model.eval()


def z_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(16, 1, 4, 6, generator=g), torch.randn(16, 1, 4, 6, generator=g)]
    captions = [torch.randn(7, 32, generator=g), torch.randn(40, 32, generator=g)]
    return latents, torch.tensor([0.25, 0.8]), captions


def max_err(got, want) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def z_setup(tiny_z_image_dir, tmp_path_factory):
    """diffusers reference, peft oracles and their PEFT directories, and the in-tree model + manager."""
    from diffusers import ZImageTransformer2DModel as Reference

    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel

    folder = tiny_z_image_dir / "transformer"
    reference = Reference.from_pretrained(str(folder)).eval()
    x, t, cap = z_inputs()
    peft = {}
    with torch.no_grad():
        for name, spec in SPECS.items():
            spec = dict(spec)
            path = str(tmp_path_factory.mktemp(f"z_{name}"))
            model = make_z_peft(reference, path, spec.pop("seed"), **spec)
            peft[name] = (path, model(x, t, cap, return_dict=False)[0])
        base_out = reference(x, t, cap, return_dict=False)[0]
    ours = ZImageTransformer2DModel.from_pretrained(folder)
    manager = DiffusionLoRAManager(ours, max_loras=1, max_rank=8, max_cpu_loras=2)
    return dict(
        folder=folder,
        reference=reference,
        ours=ours,
        manager=manager,
        peft=peft,
        base=base_out,
        inputs=(x, t, cap),
    )


_ids = iter(range(100, 10_000))


@torch.no_grad()
def run_adapter(setup, path: str, scale: float = 1.0):
    manager = setup["manager"]
    request = LoRARequest(f"l{path}", next(_ids), path)
    start = time.perf_counter()
    manager.add_lora(request)
    load_s = time.perf_counter() - start
    manager.set_active_adapters([request], [scale])
    try:
        return setup["ours"](*setup["inputs"]), load_s
    finally:
        manager.deactivate()
        manager.remove_lora(request.lora_int_id)


def _peft_dir(d, tmp):
    return d


def _peft_file(d, tmp):
    return f"{d}/adapter_model.safetensors"  # single file, sibling adapter_config.json


LAYOUTS = {
    "peft_dir": _peft_dir,
    "peft_file_with_sibling_config": _peft_file,
    "diffusers_transformer_prefix_metadata": lambda d, tmp: layouts.write_diffusers(
        d, f"{tmp}/d.safetensors"
    ),
    "peft_keys_alpha_tensors_no_config": lambda d, tmp: layouts.write_alpha_file(d, f"{tmp}/p.safetensors"),
    "comfyui_lora_A_B_alpha": lambda d, tmp: layouts.write_comfyui(d, f"{tmp}/c.safetensors"),
    "comfyui_down_up_original_names": lambda d, tmp: layouts.write_comfyui(
        d, f"{tmp}/c2.safetensors", down_up=True, rename=layouts.z_image_original_name
    ),
    "kohya_lora_unet_alpha": lambda d, tmp: layouts.write_kohya(d, f"{tmp}/k.safetensors"),
    "kohya_lora_unet_no_alpha": lambda d, tmp: layouts.write_kohya(
        d, f"{tmp}/k2.safetensors", with_alpha=False
    ),
}


@pytest.mark.parametrize("adapter", list(SPECS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_peft_on_z_image(z_setup, tmp_path, adapter, layout):
    directory, oracle = z_setup["peft"][adapter]
    path = LAYOUTS[layout](directory, str(tmp_path))
    got, load_s = run_adapter(z_setup, path)
    err = max_err(got, oracle)
    print(f"{adapter:8s} {layout:40s} max abs err vs peft {err:.2e}  load {load_s * 1e3:.1f} ms")
    assert err <= 1e-5
    assert max_err(got, z_setup["base"]) > 1e-3  # the adapter did something


def test_kohya_goes_through_diffusers_converter(z_setup, tmp_path, monkeypatch):
    """Z-Image kohya/ComfyUI files are converted by diffusers' own Z-Image converter, not by our tables."""
    from diffusers.loaders import lora_conversion_utils

    calls = []
    original = lora_conversion_utils._convert_non_diffusers_z_image_lora_to_diffusers

    def spy(state_dict):
        calls.append(len(state_dict))
        return original(state_dict)

    monkeypatch.setattr(lora_conversion_utils, "_convert_non_diffusers_z_image_lora_to_diffusers", spy)
    directory, oracle = z_setup["peft"]["pattern"]
    got, _ = run_adapter(z_setup, layouts.write_kohya(directory, str(tmp_path / "k.safetensors")))
    assert calls and max_err(got, oracle) <= 1e-5
    calls.clear()
    run_adapter(z_setup, directory)  # a PEFT directory needs no conversion
    assert calls == []


def test_other_base_model_name_only_warns(z_setup, tmp_path, caplog):
    directory, oracle = z_setup["peft"]["pattern"]
    edited = layouts.edit_peft(
        directory, str(tmp_path / "other"), config_update={"base_model_name_or_path": "someone/another-model"}
    )
    z_setup["ours"].name_or_path = str(z_setup["folder"].parent)
    try:
        with caplog.at_level(logging.WARNING):
            got, _ = run_adapter(z_setup, edited)
    finally:
        del z_setup["ours"].name_or_path
    assert "someone/another-model" in caplog.text
    assert max_err(got, oracle) <= 1e-5


@torch.no_grad()
@pytest.mark.parametrize(
    "layout", ["kohya_lora_unet_alpha", "diffusers_transformer_prefix_metadata", "peft_dir"]
)
def test_distill_fuse_takes_the_same_formats(z_setup, tmp_path, layout):
    import json

    from vllm_omni.diffusion.distributed.parallel_state import current_vllm_config_for_layers
    from vllm_omni.diffusion.models.weight_loading import finalize_linear_layers, iter_safetensors
    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel

    directory, oracle = z_setup["peft"]["pattern"]
    path = LAYOUTS[layout](directory, str(tmp_path))
    config = json.loads((z_setup["folder"] / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with current_vllm_config_for_layers():
        model = ZImageTransformer2DModel(**config, dtype=torch.float32)
    model.load_weights(iter_safetensors(z_setup["folder"]))
    fused = fuse_lora_into_model(model, path)
    finalize_linear_layers(model, keep_base_weights=True)
    err = max_err(model.eval()(*z_setup["inputs"]), oracle)
    print(f"fuse {layout}: {len(fused)} layers, max abs err vs peft {err:.2e}")
    assert err <= 1e-5


@torch.no_grad()
def test_fp16_adapter_on_bf16_base(z_setup, tmp_path):
    """A float16 file on a bfloat16 model: the LoRA delta matches peft's fp32 delta to bf16 precision."""
    from vllm_omni.diffusion.models.z_image import ZImageTransformer2DModel

    directory, oracle = z_setup["peft"]["pattern"]
    path = layouts.write_diffusers(directory, str(tmp_path / "fp16.safetensors"), dtype=torch.float16)
    adapter = load_lora_adapter(path)
    assert all(m.lora_a.dtype == torch.float32 for m in adapter.modules.values())
    model = ZImageTransformer2DModel.from_pretrained(z_setup["folder"], dtype=torch.bfloat16)
    manager = DiffusionLoRAManager(model, max_loras=1, max_rank=8)
    x, t, cap = z_setup["inputs"]
    xb, capb = [v.bfloat16() for v in x], [v.bfloat16() for v in cap]
    base = model(xb, t, capb)
    want_delta = torch.cat([(o - b).flatten() for o, b in zip(oracle, z_setup["base"], strict=True)])
    rel = {}
    for lora_id, (name, source) in enumerate((("fp16 file", path), ("fp32 peft dir", directory)), start=1):
        manager.set_active_adapters([LoRARequest(name, lora_id, source)], [1.0])
        got = model(xb, t, capb)
        manager.deactivate()
        got_delta = torch.cat([(g.float() - b.float()).flatten() for g, b in zip(got, base, strict=True)])
        rel[name] = ((got_delta - want_delta).norm() / want_delta.norm()).item()
    print(f"bf16 base, LoRA delta vs peft fp32 delta (relative L2): {rel}")
    # bf16 rounding through the whole network: a wrong scale would be off by tens of percent
    assert rel["fp16 file"] < 0.1 and abs(rel["fp16 file"] - rel["fp32 peft dir"]) < 0.01


@torch.no_grad()
@pytest.mark.parametrize("targets", ["all-linear", r".*\.(to_q|to_v|w2)", ["to_k", "ff.w1"]])
def test_generic_kohya_unflattening_and_target_forms_on_toy(toy_base, tmp_path, targets):
    """A model without a diffusers converter: kohya names are resolved against its own module names;
    target_modules as "all-linear", a full-match regex, or a list behave as peft defines them."""
    directory = str(tmp_path / "peft")
    peft_model = save_peft_adapter(toy_base, directory, seed=3, targets=targets, r=4, lora_alpha=6.0)
    x, c = inputs(batch=2)
    want = peft_model(x, c)
    model = make_vllm_dit(toy_base.state_dict())
    manager = DiffusionLoRAManager(model, max_loras=1, max_rank=8, max_cpu_loras=2)
    for lora_id, path in enumerate(
        [directory, layouts.write_kohya(directory, str(tmp_path / "k.safetensors"))], start=1
    ):
        request = LoRARequest(f"t{lora_id}", lora_id, path)
        manager.set_active_adapters([request], [1.0])
        err = (model(x, c) - want).abs().max().item()
        manager.deactivate()
        print(f"toy {targets!s:24s} {path.rsplit('/', 1)[-1]:28s} max abs err {err:.2e}")
        assert err <= 1e-5
