"""Cache, slot and validation rules of DiffusionLoRAManager; every failure leaves the state as it was."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from lora_toy_models import inputs, make_vllm_dit, save_peft_adapter
from safetensors.torch import load_file, save_file

from vllm_omni.diffusion.lora import DiffusionLoRAManager
from vllm_omni.diffusion.lora.loading import load_lora_adapter
from vllm_omni.errors import LoRACacheError, LoRAFormatError
from vllm_omni.lora.request import LoRARequest


class CountingLoader:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, path: str):
        self.calls.append(path)
        return load_lora_adapter(path)


@pytest.fixture(scope="module")
def model(toy_base):
    return make_vllm_dit(toy_base.state_dict())


@pytest.fixture(scope="module")
def extra_dirs(toy_base, adapters, tmp_path_factory):
    """Adapter directories that must be rejected, plus copies of "a" under new ids."""
    root = tmp_path_factory.mktemp("bad")
    a_dir = adapters["a"][0]

    def variant(name: str, rename=None, add=None) -> str:
        path = str(root / name)
        shutil.copytree(a_dir, path)
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        if rename:
            tensors = {rename(k): v for k, v in tensors.items()}
        tensors.update(add or {})
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        return path

    out = {f"copy{i}": variant(f"copy{i}") for i in range(4)}
    out["partial"] = variant(
        "partial",
        add={
            "base_model.model.blocks.0.attn.to_added.lora_A.weight": torch.zeros(4, 32),
            "base_model.model.blocks.0.attn.to_added.lora_B.weight": torch.zeros(32, 4),
        },
    )
    out["none"] = variant("none", rename=lambda k: k.replace("blocks.", "layers."))
    out["dora"] = str(root / "dora")
    save_peft_adapter(toy_base, out["dora"], seed=1, targets=["to_q"], use_dora=True)
    out["mts"] = str(root / "mts")
    save_peft_adapter(toy_base, out["mts"], seed=1, targets=["to_q"], modules_to_save=["adaLN"])
    out["rank_mismatch"] = variant("rank_mismatch")
    cfg_path = os.path.join(out["rank_mismatch"], "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["r"] = 5
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return out


def _req(path: str, lora_id: int) -> LoRARequest:
    return LoRARequest(f"lora{lora_id}", lora_id, path)


def _state(manager: DiffusionLoRAManager):
    return manager.list_loras(), manager.slot_assignment(), manager.slot_writes


def _new_manager(model, **kw) -> tuple[DiffusionLoRAManager, CountingLoader]:
    loader = CountingLoader()
    for name, wrapper in list(getattr(model, "_lora_wrappers", {}).items()):  # unpatch from a previous test
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, wrapper.base_layer)
    manager = DiffusionLoRAManager(model, adapter_loader=loader, **kw)
    model._lora_wrappers = manager.wrappers
    return manager, loader


def test_lru_eviction_and_touch(model, extra_dirs):
    mgr, loader = _new_manager(model, max_loras=1, max_rank=8, max_cpu_loras=2)
    assert mgr.add_lora(_req(extra_dirs["copy0"], 1)) is True
    assert mgr.add_lora(_req(extra_dirs["copy1"], 2)) is True
    assert mgr.add_lora(_req(extra_dirs["copy0"], 1)) is False  # cached: touched, not reloaded
    assert len(loader.calls) == 2
    assert mgr.list_loras() == [2, 1]
    assert mgr.add_lora(_req(extra_dirs["copy2"], 3)) is True  # evicts 2 (least recently used)
    assert mgr.list_loras() == [1, 3]
    mgr.set_active_adapters([_req(extra_dirs["copy0"], 1)], [1.0])  # touch 1, slot it
    assert mgr.slot_assignment() == {1: 0}
    mgr.deactivate()
    mgr.add_lora(_req(extra_dirs["copy1"], 2))  # evicts 3
    assert mgr.list_loras() == [1, 2]
    mgr.add_lora(_req(extra_dirs["copy2"], 3))  # evicts 1 and frees its slot
    assert mgr.list_loras() == [2, 3] and mgr.slot_assignment() == {}


def test_pinned_adapters_are_never_evicted(model, extra_dirs):
    mgr, loader = _new_manager(model, max_loras=1, max_rank=8, max_cpu_loras=2)
    mgr.add_lora(_req(extra_dirs["copy0"], 1))
    mgr.add_lora(_req(extra_dirs["copy1"], 2))
    assert mgr.pin_lora(1) is True
    mgr.add_lora(_req(extra_dirs["copy2"], 3))  # 1 is LRU but pinned: 2 goes
    assert mgr.list_loras() == [1, 3]
    mgr.pin_lora(3)
    before, calls = _state(mgr), len(loader.calls)
    with pytest.raises(LoRACacheError, match="pinned"):
        mgr.add_lora(_req(extra_dirs["copy3"], 4))
    assert _state(mgr) == before and len(loader.calls) == calls  # nothing read, nothing changed
    with pytest.raises(ValueError, match="not loaded"):
        mgr.pin_lora(99)
    mgr.unpin_lora(3)
    mgr.add_lora(_req(extra_dirs["copy3"], 4))
    assert mgr.list_loras() == [1, 4]


@torch.no_grad()
def test_a_pinned_adapter_updates_in_place_with_every_entry_pinned(model, adapters, extra_dirs):
    """Issue 46, the RL rollout set-up on a diffusion stage (``max_loras=1, max_cpu_loras=1``, the one
    adapter pinned): each new version of the adapter (same name, new id) is read and checked off-slot,
    then takes the old one's pinned place; the output equals peft with that version's weights. A refused
    version, or one arriving while a request holds the old one, leaves the old one cached, pinned, serving."""
    mgr, _ = _new_manager(model, max_loras=1, max_rank=8, max_cpu_loras=1)
    x, c = inputs(batch=1)
    versions = [adapters["a"][0], adapters["b"][0]] * 3  # the trainer's steps, alternating weights
    oracle = {adapters[k][0]: adapters[k][1] for k in ("a", "b")}  # peft models on copies of toy_base
    for step, folder in enumerate(versions, start=1):
        mgr.add_lora(LoRARequest("policy", step, folder))
        if step == 1:
            mgr.pin_lora(1)
        assert mgr.list_loras() == [step] and mgr.cache_entry(step).pinned
        mgr.set_active_adapters([LoRARequest("policy", step, folder)], [1.0])
        ours = model(x, c)
        mgr.deactivate()
        expected = oracle[folder](x, c)
        assert (ours - expected).abs().max() <= 1e-5, f"version {step}"
    last = len(versions)
    with pytest.raises(LoRAFormatError):  # refused: the old version stays
        mgr.add_lora(LoRARequest("policy", 50, extra_dirs["rank_mismatch"]))
    held = mgr.acquire_loras([LoRARequest("policy", last, versions[-1])])
    with pytest.raises(LoRACacheError, match="in use"):  # a request holds the old version
        mgr.add_lora(LoRARequest("policy", 51, extra_dirs["copy0"]))
    mgr.release_loras(held)
    with pytest.raises(LoRACacheError, match="pinned"):  # another name never takes a pinned place
        mgr.add_lora(LoRARequest("other", 52, extra_dirs["copy0"]))
    assert mgr.list_loras() == [last] and mgr.cache_entry(last).pinned


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (
            "partial",
            LoRAFormatError,
            r"1 of 17 modules.*blocks\.0\.attn\.to_added.*; matched: '\S+' -> 'blocks",
        ),
        ("none", LoRAFormatError, r"none of its modules.*layers\.0\.adaLN"),
        ("dora", LoRAFormatError, "use_dora"),
        ("mts", LoRAFormatError, "modules_to_save"),
        ("rank_mismatch", LoRAFormatError, "stores rank 4 but the config declares rank 5"),
        ("missing", FileNotFoundError, "not found"),
    ],
)
def test_failed_load_leaves_cache_and_slots_unchanged(model, extra_dirs, bad, error, match):
    mgr, _ = _new_manager(model, max_loras=2, max_rank=8, max_cpu_loras=2)
    mgr.set_active_adapters([_req(extra_dirs["copy0"], 1), _req(extra_dirs["copy1"], 2)], [1.0, 1.0])
    mgr.deactivate()
    before = _state(mgr)
    path = extra_dirs.get(bad, "/nonexistent/adapter")
    with pytest.raises(error, match=match):
        mgr.add_lora(_req(path, 7))  # the cache is full: a victim is planned, but kept on failure
    assert _state(mgr) == before
    with pytest.raises(error, match=match):
        mgr.set_active_adapters([[_req(extra_dirs["copy0"], 1), _req(path, 7)]], [[1.0, 1.0]])
    assert _state(mgr) == before


def test_rank_above_max_rank_names_both_ranks(model, adapters):
    mgr, _ = _new_manager(model, max_loras=1, max_rank=8)
    with pytest.raises(LoRAFormatError, match=r"max_rank 8.*\(rank 16\)"):
        mgr.add_lora(_req(adapters["big"][0], 5))
    assert mgr.list_loras() == [] and mgr.slot_assignment() == {}


def test_validation_errors_happen_before_any_work(model, extra_dirs):
    mgr, loader = _new_manager(model, max_loras=2, max_rank=8, max_cpu_loras=3)
    r1, r2, r3 = (_req(extra_dirs[f"copy{i}"], i + 1) for i in range(3))
    mgr.set_active_adapters([r1], [1.0])
    before, calls = _state(mgr), len(loader.calls)
    cases = [
        (([[r1], [r2]], [[1.0]]), "2 request entries but 1 scale"),
        (([[r1, r2]], [[1.0]]), "2 adapters but 1 scales"),
        (([[r1, r2, r3]], [[1.0, 1.0, 1.0]]), "exceed max_loras=2"),
        (([[r1], [r2], [r3]], [[1.0], [1.0], [1.0]]), "3 distinct adapters; max_loras=2"),
        (([[r2, r2]], [[1.0, 0.5]]), "appears twice"),
        (([[r2]], [[math.nan]]), "finite"),
        (([[r2]], [[math.inf]]), "finite"),
        (([[r2]], [["1.0"]]), "finite"),
        (([[object()]], [[1.0]]), "must be a LoRARequest.*positive lora_int_id"),
        (([[LoRARequest("x", 2, "/elsewhere")], [r2]], [[1.0], [1.0]]), "two paths"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            mgr.set_active_adapters(*args)
        assert _state(mgr) == before and len(loader.calls) == calls
        assert mgr.active_lora_ids == (1,)  # the previous activation is untouched
    with pytest.raises(ValueError, match="cached for"):
        mgr.add_lora(LoRARequest("x", 1, "/elsewhere"))


def test_in_flight_adapters_cannot_be_evicted_or_removed(model, extra_dirs):
    mgr, _ = _new_manager(model, max_loras=1, max_rank=8, max_cpu_loras=1)
    r1, r2 = _req(extra_dirs["copy0"], 1), _req(extra_dirs["copy1"], 2)
    x, c = inputs(batch=1)
    with torch.no_grad(), mgr.activate([r1], [1.0]):
        first = model(x, c)
        with pytest.raises(LoRACacheError, match="in use|current activation"):
            mgr.remove_lora(1)
        with pytest.raises(LoRACacheError, match="in use"):
            mgr.add_lora(r2)  # would have to evict 1
        assert mgr.list_loras() == [1]
        assert torch.equal(model(x, c), first)  # later steps still run with the adapter
    assert mgr.active_lora_ids == () and mgr.cache_entry(1).refcount == 0
    held = mgr.acquire_loras([r1])
    mgr.set_active_adapters([r1], [0.5])
    mgr.deactivate()
    with pytest.raises(LoRACacheError, match="in-flight"):
        mgr.remove_lora(1)
    mgr.release_loras(held)
    assert mgr.remove_lora(1) is True and mgr.remove_lora(1) is False
    assert mgr.list_loras() == [] and mgr.slot_assignment() == {}


def test_slot_lru_prefers_evicting_unpinned(model, extra_dirs):
    mgr, loader = _new_manager(model, max_loras=2, max_rank=8, max_cpu_loras=4)
    r = [_req(extra_dirs[f"copy{i}"], i + 1) for i in range(4)]
    mgr.set_active_adapters([r[0], r[1]], [1.0, 1.0])
    mgr.pin_lora(1)
    mgr.set_active_adapters([r[2]], [1.0])  # needs a slot: takes 2's (1 is pinned)
    assert mgr.slot_assignment() == {1: 0, 3: 1}
    mgr.set_active_adapters([r[0], r[3]], [1.0, 1.0])  # 3 not needed -> its slot goes to 4
    assert mgr.slot_assignment() == {1: 0, 4: 1}
    assert len(loader.calls) == 4


def test_model_is_unchanged_when_nothing_is_active(model, toy_base, extra_dirs):
    mgr, _ = _new_manager(model, max_loras=1, max_rank=8)
    x, c = inputs(batch=2)
    with torch.no_grad():
        base = model(x, c)
        mgr.set_active_adapters([_req(extra_dirs["copy0"], 1)], [1.0])
        assert not torch.allclose(model(x, c), base)
        mgr.deactivate()
        assert torch.equal(model(x, c), base)
