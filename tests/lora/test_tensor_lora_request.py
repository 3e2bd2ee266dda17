"""``TensorLoRARequest`` itself (issue 40), no engine: the hand-over copies, the version is the content,
pickling (the ``mp`` / Ray transports) keeps the copy and its hash, and structural refusals name the key."""

from __future__ import annotations

import pickle

import pytest
import torch
from peft import LoraConfig

from vllm_omni.errors import InvalidAdapterError
from vllm_omni.ipc import dump, load
from vllm_omni.lora.request import LoRARequest, TensorLoRARequest

CONFIG = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]).to_dict()  # PeftType enum, a set


def _tensors(seed: int = 0, prefix: str = "base_model.model.") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"{prefix}model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 8, generator=gen),
        f"{prefix}model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, 2, generator=gen),
    }


def test_hand_over_copies_and_the_content_is_the_version():
    trainer = _tensors()
    lora = TensorLoRARequest(lora_name="p", lora_int_id=1, peft_config=CONFIG, lora_tensors=trainer)
    assert isinstance(lora, LoRARequest) and lora.lora_path == "tensors://p"
    assert lora.peft_config["peft_type"] == "LORA" and lora.peft_config["target_modules"] == ["q_proj"]
    before = lora.content_sha256
    for t in trainer.values():
        t.add_(1.0)  # an optimizer step in place after the hand-over
    assert all(not torch.equal(lora.lora_tensors[k], v) for k, v in trainer.items())
    again = TensorLoRARequest(lora_name="p", lora_int_id=1, peft_config=CONFIG, lora_tensors=_tensors())
    assert again.content_sha256 == before  # same content, same version
    unprefixed = TensorLoRARequest(
        lora_name="p", lora_int_id=1, peft_config=CONFIG, lora_tensors=_tensors(prefix="")
    )
    assert unprefixed.content_sha256 == before and set(unprefixed.lora_tensors) == set(lora.lora_tensors)
    assert (
        TensorLoRARequest(
            lora_name="p", lora_int_id=1, peft_config=CONFIG, lora_tensors=trainer
        ).content_sha256
        != before
    )


def test_pickling_keeps_the_copy_and_its_hash():
    lora = TensorLoRARequest(lora_name="p", lora_int_id=1, peft_config=CONFIG, lora_tensors=_tensors())
    for back in (
        pickle.loads(pickle.dumps(lora)),
        load(dump(lora)),
    ):  # plain pickle (Ray), ForkingPickler (mp)
        assert type(back) is TensorLoRARequest and back.content_sha256 == lora.content_sha256
        assert all(torch.equal(back.lora_tensors[k], v) for k, v in lora.lora_tensors.items())
    engine = lora.engine_form("p", 99)
    assert engine.lora_int_id == 99 and engine.lora_tensors is lora.lora_tensors  # no copy


@pytest.mark.parametrize(
    "config, tensors, needle",
    [
        ({**CONFIG, "peft_type": "LOHA"}, _tensors(), "not LoRA"),
        ({k: v for k, v in CONFIG.items() if k != "lora_alpha"}, _tensors(), "lora_alpha"),
        ({**CONFIG, "use_dora": True}, _tensors(), "use_dora"),
        (CONFIG, {"a.lora_A.weight": torch.zeros(2, 2, dtype=torch.int8)}, "a.lora_A.weight"),
        (CONFIG, {"a.lora_A.weight": [1.0]}, "a.lora_A.weight"),
        (CONFIG, {}, "non-empty"),
        ("r=2", _tensors(), "peft_config"),
    ],
)
def test_structural_refusals_name_the_field_or_key(config, tensors, needle):
    with pytest.raises(InvalidAdapterError, match=needle):
        TensorLoRARequest(lora_name="p", lora_int_id=1, peft_config=config, lora_tensors=tensors)


def test_an_llm_stage_with_its_engine_core_elsewhere_refuses_in_memory_adapters(monkeypatch):
    from vllm_omni.engine import tensor_lora

    lora = TensorLoRARequest(lora_name="p", lora_int_id=1, peft_config=CONFIG, lora_tensors=_tensors())
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(InvalidAdapterError, match="VLLM_ENABLE_V1_MULTIPROCESSING"):
        tensor_lora.remember(lora, object(), "Stage 0 (llm)")
    assert tensor_lora.held(lora.lora_path) is None


def test_two_engines_in_one_process_keep_their_own_contents(monkeypatch):
    """Two stages (two ``Omni`` in one process) may both use id 1 for other weights: the table is keyed
    by the content-naming path of the engine form, and each stage releases only what it held."""
    from vllm_omni.engine import tensor_lora

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    x, y = (
        TensorLoRARequest(
            lora_name="p", lora_int_id=1, peft_config=CONFIG, lora_tensors=_tensors(s)
        ).engine_form("p", 1)
        for s in (1, 2)
    )
    assert x.lora_path != y.lora_path and x.lora_path.startswith("tensors://p#")
    first, second = object.__new__(type("Stage", (), {})), object.__new__(type("Stage", (), {}))
    tensor_lora.remember(x, first, "stage a")
    tensor_lora.remember(y, second, "stage b")
    assert tensor_lora.held(x.lora_path) is x and tensor_lora.held(y.lora_path) is y
    tensor_lora.forget(1, first)
    assert tensor_lora.held(x.lora_path) is None and tensor_lora.held(y.lora_path) is y
    del second  # a stage that goes away releases what it held
    import gc

    gc.collect()
    assert tensor_lora.held(y.lora_path) is None
