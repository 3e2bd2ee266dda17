"""The one adapter-file module: location, pickle refusal, config, tensor pairing, pattern keys.

Every gate (LLM stage, diffusion readers, HTTP registry) calls it, so one refusal here is the
same refusal everywhere; the gate tests (tests/engine, tests/diffusion/lora, tests/entrypoints)
check the wording each gate adds.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from vllm_omni.diffusion.lora.loading import load_lora_adapter
from vllm_omni.entrypoints.openai.lora import check_adapter_files
from vllm_omni.errors import InvalidAdapterError, LoRAFormatError, OpenAIError
from vllm_omni.lora.adapter_files import (
    PICKLE_SUFFIXES,
    AdapterFiles,
    declared_rank_alpha,
    locate_adapter,
    lora_config_from_dict,
    pair_lora_tensors,
    read_adapter_config,
)

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["to_q"]}
A, B = "base_model.model.blocks.0.to_q.lora_A.weight", "base_model.model.blocks.0.to_q.lora_B.weight"


def _peft_dir(path, config=CONFIG, tensors=None):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors or {A: torch.ones(2, 8), B: torch.ones(8, 2)}, path / "adapter_model.safetensors")
    return path


def test_locate_peft_directory_and_single_file(tmp_path):
    peft = _peft_dir(tmp_path / "peft")
    files = locate_adapter(peft)
    assert files.is_directory and files.weights.endswith("adapter_model.safetensors") and files.config
    single = tmp_path / "one.safetensors"
    save_file({A: torch.ones(2, 8), B: torch.ones(8, 2)}, single)
    assert locate_adapter(single).config is None and not locate_adapter(single).is_directory
    # the sibling config of peft's save_pretrained layout is found for a file inside the directory
    assert locate_adapter(peft / "adapter_model.safetensors").config == files.config


def test_locate_refusals_name_the_adapter(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        locate_adapter(tmp_path / "absent")
    with pytest.raises(LoRAFormatError, match="not a directory"):
        locate_adapter(tmp_path / "absent", directory_only=True)
    (tmp_path / "no_config").mkdir()
    (tmp_path / "no_config" / "adapter_model.safetensors").write_bytes(b"")
    # one .safetensors and no config: that file (issue 35); the LLM gate (vLLM) still needs a PEFT folder
    single = str(tmp_path / "no_config" / "adapter_model.safetensors")
    assert locate_adapter(tmp_path / "no_config") == AdapterFiles(single, None, True)
    with pytest.raises(LoRAFormatError, match="no_config: missing adapter_config.json"):
        locate_adapter(tmp_path / "no_config", directory_only=True)
    (tmp_path / "no_config" / "other.safetensors").write_bytes(b"")
    with pytest.raises(LoRAFormatError, match="no_config: missing adapter_config.json"):
        locate_adapter(tmp_path / "no_config")
    (tmp_path / "text.txt").write_text("x")
    with pytest.raises(LoRAFormatError, match="shown-name: not a .safetensors file"):
        locate_adapter(tmp_path / "text.txt", shown="shown-name")


@pytest.mark.parametrize("suffix", PICKLE_SUFFIXES)
def test_every_gate_refuses_every_pickle_suffix(tmp_path, suffix):
    single = tmp_path / f"weights{suffix}"
    single.write_bytes(b"not loaded")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(CONFIG))
    (folder / f"adapter_model{suffix}").write_bytes(b"not loaded")
    for path in (single, folder):
        with pytest.raises(LoRAFormatError, match="pickle"):
            locate_adapter(path)
        with pytest.raises(LoRAFormatError, match="pickle"):
            load_lora_adapter(path)  # diffusion reader
        with pytest.raises(OpenAIError) as info:
            check_adapter_files(str(path), "client/path")  # HTTP registry
        assert "pickle" in info.value.message and str(tmp_path) not in info.value.message
    with pytest.raises(LoRAFormatError, match=rf"pickle files \['adapter_model{suffix}'\] are refused"):
        locate_adapter(folder, directory_only=True)  # LLM gate


@pytest.mark.parametrize(
    "update, match",
    [
        ({"lora_alpha": None}, "has no lora_alpha"),
        ({"r": "8"}, "'r' must be an integer"),
        ({"lora_alpha": float("nan")}, "'lora_alpha' must be a finite number"),
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"peft_type": "LOHA"}, "is not LoRA"),
    ],
)
def test_config_refusals_name_the_source(tmp_path, update, match):
    path = _peft_dir(tmp_path / "a", config={**CONFIG, **update})
    with pytest.raises(LoRAFormatError, match=rf"^my-adapter: .*{match}"):
        read_adapter_config(str(path), source="my-adapter")
    assert issubclass(LoRAFormatError, InvalidAdapterError) and issubclass(LoRAFormatError, ValueError)


def test_rank_and_alpha_patterns_follow_peft():
    config = lora_config_from_dict(
        {**CONFIG, "rank_pattern": {"blocks.1.to_q": 4}, "alpha_pattern": {r"blocks\.\d+\.to_q": 16}}, "x"
    )
    assert declared_rank_alpha(config, "blocks.0.to_q") == (2, 16)
    assert declared_rank_alpha(config, "blocks.1.to_q") == (4, 16)
    assert declared_rank_alpha(config, "blocks.0.to_k") == (2, 4)
    assert declared_rank_alpha(config, "xblocks.1.to_q") == (2, 4)  # patterns match on a dot boundary


@pytest.mark.parametrize(
    "tensors, match",
    [
        ({A: torch.ones(2, 8)}, r"only one of lora_A / lora_B: \['base_model.model.blocks.0.to_q'\]"),
        ({A: torch.ones(2, 8, dtype=torch.int8), B: torch.ones(8, 2)}, r"torch\.int8.*lora_A"),
        ({A: torch.full((2, 8), float("nan")), B: torch.ones(8, 2)}, "blocks.0.to_q' holds NaN or inf"),
        ({A: torch.ones(2, 8), B: torch.ones(8, 3)}, "lora_A rank 2 but lora_B rank 3"),
        (
            {A: torch.ones(2, 8), B: torch.ones(8, 2), "emb.weight": torch.ones(1)},
            "not LoRA A/B.*'emb.weight'",
        ),
    ],
)
def test_tensor_refusals_name_file_and_module(tensors, match):
    with pytest.raises(LoRAFormatError, match=rf"^f\.safetensors: .*{match}"):
        pair_lora_tensors(tensors, "f.safetensors")


def test_pairs_are_float32_and_grouped_by_module():
    pairs, alphas = pair_lora_tensors({A: torch.ones(2, 8, dtype=torch.float16), B: torch.ones(8, 2)}, "f")
    ((module, (a, b)),) = pairs.items()
    assert module == "base_model.model.blocks.0.to_q" and a.dtype == b.dtype == torch.float32 and not alphas
