"""Issue 21 rule 7 (files): LyCORIS files keyed ``lycoris_<flat module>`` read like their ``lora_unet_``
form; a folder holding one single-file adapter and no ``adapter_config.json`` is read as that file
(issue 35), one holding several is refused with a message that says what a PEFT folder needs and how
to pass a file.

Values: the ``lycoris_`` file gives exactly the output of the same tensors under ``lora_unet_`` and matches
a hand merge ``W + s B A`` (LoRA) / peft's merge (LoHa, LoKr) on the toy DiT, fp32.
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
from lora_toy_models import PEFT_TARGETS, inputs, make_vllm_dit
from safetensors.torch import load_file, save_file

from tools.lora_layouts import write_kohya, write_lycoris
from vllm_omni.diffusion.lora import DiffusionLoRAManager
from vllm_omni.diffusion.lora.loading import load_lora_adapter
from vllm_omni.errors import LoRAFormatError
from vllm_omni.lora.adapter_files import locate_adapter
from vllm_omni.lora.request import LoRARequest

TOL = 1e-4


def _hand_merge(base, peft_dir: str, scale: float):
    """``W + scale * s * B @ A`` per module, from the PEFT files and config by hand (no peft code)."""
    import json

    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        config = json.load(f)
    s = config["lora_alpha"] / config["r"]
    tensors = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            params[f"{module}.weight"] += scale * s * (b.double() @ a.double()).float()
    return model.eval()


def _peft_merge(base, path: str, scale: float):
    from peft import PeftModel
    from peft.tuners.lycoris_utils import LycorisLayer

    model = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    for module in model.modules():
        if isinstance(module, LycorisLayer):
            module.set_scale("default", scale)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def setup(toy_base, adapters, tmp_path_factory):
    import peft

    root = tmp_path_factory.mktemp("flat_prefix")
    files = {}
    lora_dir = adapters["a"][0]
    files["lora"] = (lora_dir, write_kohya(lora_dir, str(root / "k.safetensors")))
    files["lora_lycoris"] = write_kohya(lora_dir, str(root / "ly.safetensors"), prefix="lycoris_")
    for name, cls, kwargs in (
        ("loha", "LoHaConfig", {"r": 4, "alpha": 6.0}),
        ("lokr", "LoKrConfig", {"r": 2}),
    ):
        model = peft.get_peft_model(
            copy.deepcopy(toy_base), getattr(peft, cls)(target_modules=PEFT_TARGETS, **kwargs)
        )
        gen = torch.Generator().manual_seed(77)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "hada_" in pname or "lokr_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        model.save_pretrained(str(root / name))
        files[name] = (str(root / name), write_lycoris(str(root / name), str(root / f"{name}_k.safetensors")))
        files[name + "_lycoris"] = write_lycoris(
            str(root / name), str(root / f"{name}_ly.safetensors"), prefix="lycoris_"
        )
    model = make_vllm_dit(toy_base.state_dict())
    manager = DiffusionLoRAManager(model, max_loras=2, max_rank=8, max_cpu_loras=4)
    return {"root": root, "files": files, "model": model, "manager": manager}


def _run(setup, path: str, lora_id: int, scale: float = 0.8) -> torch.Tensor:
    x, c = inputs(batch=2)
    manager = setup["manager"]
    manager.set_active_adapters([LoRARequest(f"a{lora_id}", lora_id, path)], [scale])
    try:
        with torch.no_grad():
            return setup["model"](x, c)
    finally:
        manager.deactivate()
        manager.remove_lora(lora_id)


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr"])
def test_lycoris_prefix_reads_like_lora_unet(toy_base, setup, kind):
    files = setup["files"]
    source_dir, kohya_file = files[kind]
    lycoris_file = files[kind + "_lycoris"]
    assert all(k.startswith("lycoris_") for k in load_file(lycoris_file))
    ours = _run(setup, lycoris_file, 1)
    same = _run(setup, kohya_file, 2)
    x, c = inputs(batch=2)
    with torch.no_grad():
        oracle_model = (
            _hand_merge(toy_base, source_dir, 0.8)
            if kind == "lora"
            else _peft_merge(toy_base, source_dir, 0.8)
        )
        oracle = oracle_model(x, c)
        base = toy_base(x, c)
    assert torch.equal(ours, same)  # the same tensors under another prefix: the same bits
    assert (ours - oracle).abs().max().item() <= TOL
    assert (ours - base).abs().max().item() > 1e-2


def test_both_prefixes_for_one_module_is_refused_and_changes_nothing(setup, tmp_path):
    files = setup["files"]
    tensors = load_file(files["lora"][1])
    key = next(k for k in tensors if k.endswith(".lora_down.weight"))
    tensors["lycoris_" + key.removeprefix("lora_unet_")] = tensors[key].clone()
    bad = str(tmp_path / "both.safetensors")
    save_file(tensors, bad)
    manager = setup["manager"]
    before = manager.list_loras()
    with pytest.raises(LoRAFormatError) as info:
        manager.add_lora(LoRARequest("both", 9, bad))
    message = str(info.value)
    assert message.startswith(bad) and "both 'lycoris_' and 'lora_unet_'" in message
    assert key.removeprefix("lora_unet_") in message
    assert manager.list_loras() == before


def test_folder_with_one_single_file_loads_that_file(setup, tmp_path, caplog):
    """Issue 35 rule 4: a folder holding exactly one ``.safetensors`` and no ``adapter_config.json`` is
    that file: the same modules, scalings and served output as the file by its own path, and the log
    names the file. A folder with two such files is still refused, naming both."""
    folder = tmp_path / "my_lora"
    folder.mkdir()
    single = folder / "my_lora_v2.safetensors"
    shutil.copy(setup["files"]["lora"][1], single)
    files = locate_adapter(folder)
    assert (files.weights, files.config, files.is_directory) == (str(single), None, True)
    with caplog.at_level("INFO", logger="vllm_omni.diffusion.lora.loading"):
        from_folder = load_lora_adapter(str(folder))
    assert f"loading its single file {single}" in caplog.text
    by_path = load_lora_adapter(str(single))
    assert from_folder.source == by_path.source == str(single)
    assert sorted(from_folder.modules) == sorted(by_path.modules)
    for key, module in by_path.modules.items():
        got = from_folder.modules[key]
        assert torch.equal(got.lora_a, module.lora_a) and torch.equal(got.lora_b, module.lora_b)
        assert got.scaling == module.scaling
    served = _run(setup, str(folder), 11)
    assert torch.equal(served, _run(setup, str(single), 12))
    assert torch.equal(served, _run(setup, setup["files"]["lora"][1], 13))

    second = folder / "other.safetensors"
    shutil.copy(single, second)
    manager = setup["manager"]
    before = manager.list_loras()
    for call in (
        lambda: locate_adapter(folder),
        lambda: load_lora_adapter(str(folder)),
        lambda: manager.add_lora(LoRARequest("folder", 14, str(folder))),
    ):
        with pytest.raises(LoRAFormatError) as info:
            call()
        message = str(info.value)
        assert message.startswith(str(folder)), message
        assert "missing adapter_config.json and adapter_model.safetensors" in message
        assert f"'{single}'" in message and f"'{second}'" in message
        assert "pass one by its own path instead" in message
    assert manager.list_loras() == before


def test_llm_gate_names_the_single_file_and_what_vllm_needs(tmp_path):
    folder = tmp_path / "llm_lora"
    folder.mkdir()
    save_file({"x.lora_A.weight": torch.zeros(2, 4)}, str(folder / "lora.safetensors"))
    with pytest.raises(LoRAFormatError) as info:
        locate_adapter(folder, shown="adapter 'mine'", directory_only=True)
    message = str(info.value)
    assert message.startswith("adapter 'mine': missing adapter_config.json and adapter_model.safetensors")
    assert (
        str(folder / "lora.safetensors") in message
        and "save the adapter with peft's save_pretrained" in message
    )
