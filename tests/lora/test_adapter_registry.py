"""The adapter registry's rules on stand-in stages (issue 21, rules 1 and 2): a name is a version, and
registration is all-or-nothing and linearizable. Real engines check the same rules in
``tests/engine/test_adapter_versions.py`` and over HTTP in ``tests/entrypoints/test_registry_server.py``."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tests.lora.fake_stages import FakeStages
from vllm_omni.engine.vllm_adapter_names import vllm_lora_request
from vllm_omni.errors import InvalidAdapterError, LoRANotEnabledError
from vllm_omni.lora.registry import AdapterRegistry
from vllm_omni.lora.request import LoRARequest


def _adapter(folder: Path, weights: bytes) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8}')
    _rewrite(folder, weights)
    return str(folder)


def _rewrite(folder: Path | str, weights: bytes) -> None:
    path = Path(folder) / "adapter_model.safetensors"
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_bytes(weights)
    os.utime(path, ns=(before + 10**9, before + 10**9))  # a new mtime even on a coarse clock


def _registry(stages: FakeStages) -> AdapterRegistry:
    return AdapterRegistry(stages.call, 0, {i: f"Stage {i}" for i in range(stages.n)})


def test_remove_then_add_after_a_rewrite_is_a_new_version_on_every_cache(tmp_path):
    stages = FakeStages(1)
    reg = _registry(stages)
    path = _adapter(tmp_path / "a", b"old")
    assert reg.add(LoRARequest("a", 1, path))
    first = reg.get("a").engine
    assert first.lora_int_id == 1 and first.lora_name == "a"  # stages see the public name
    assert reg.remove(1) and stages.loaded[0] == {}
    _rewrite(path, b"new")
    assert reg.add(LoRARequest("a", 1, path))
    second = reg.get("a").engine
    # a fresh engine id (vLLM / diffusion caches key by id), so vLLM gets another name too (its prefix
    # cache keys by name)
    assert second.lora_int_id != 1 and second.lora_name == "a"
    assert vllm_lora_request(second).lora_name != vllm_lora_request(first).lora_name
    assert set(stages.loaded[0]) == {second.lora_int_id}
    assert reg.list_ids() == {1} and reg.get("a").version == 1  # the public id is still 1


def test_same_content_is_a_no_op_and_new_content_replaces_the_old_version(tmp_path):
    stages = FakeStages(1)
    reg = _registry(stages)
    path = _adapter(tmp_path / "a", b"v1")
    assert reg.add(LoRARequest("a", 1, path)) is True
    assert reg.pin(1) and stages.pinned[0] == {1}
    assert reg.add(LoRARequest("a", 1, path)) is False
    assert reg.add(LoRARequest("a", 1, path), reload=True) is False  # re-read: same bytes
    _rewrite(path, b"v2")
    assert reg.add(LoRARequest("a", 1, path), reload=True) is True  # HTTP load_inplace
    record = reg.get("a")
    assert record.version == 2 and set(stages.loaded[0]) == {record.engine.lora_int_id}
    assert stages.pinned[0] == {record.engine.lora_int_id}  # the pin moved to the new version
    other = _adapter(tmp_path / "b", b"other")
    assert reg.add(LoRARequest("a", 2, other))  # a new path: a new version under a new id
    assert reg.by_id(1) is None and reg.get("a").int_id == 2 and reg.get("a").version == 3
    assert set(stages.loaded[0]) == {reg.get("a").engine.lora_int_id}


def test_a_request_gets_the_new_version_after_the_files_changed(tmp_path):
    stages = FakeStages(1)
    reg = _registry(stages)
    path = _adapter(tmp_path / "a", b"v1")
    first = reg.resolve(LoRARequest("a", 5, path))
    again = reg.resolve(LoRARequest("a", 5, path + "/"))
    assert (again.lora_int_id, again.lora_path) == (
        first.lora_int_id,
        first.lora_path,
    ) and first.lora_int_id == 5
    _rewrite(path, b"v2")
    second = reg.resolve(LoRARequest("a", 5, path))
    assert (
        second.lora_int_id != 5 and vllm_lora_request(second).lora_name != vllm_lora_request(first).lora_name
    )
    assert reg.public_id(second.lora_int_id) == 5
    # a registered adapter is re-registered (loaded anew, the old version dropped)
    assert reg.add(LoRARequest("b", 6, _adapter(tmp_path / "b", b"b1")))
    _rewrite(tmp_path / "b", b"b2")
    engine = reg.resolve(LoRARequest("b", 6, str(tmp_path / "b")))
    assert set(stages.loaded[0]) == {engine.lora_int_id} and reg.get("b").version == 2


def test_an_id_never_switches_weights_until_removed(tmp_path):
    reg = _registry(FakeStages(1))
    a, b = _adapter(tmp_path / "a", b"a"), _adapter(tmp_path / "b", b"b")
    reg.resolve(LoRARequest("a", 31, a))
    with pytest.raises(InvalidAdapterError, match=r"adapter 'b'.*lora_int_id 31 already names adapter .*a'"):
        reg.resolve(LoRARequest("b", 31, b))
    with pytest.raises(InvalidAdapterError, match="lora_int_id 31 already names"):
        reg.add(LoRARequest("b", 31, b))
    reg.add(LoRARequest("named", 32, a))
    with pytest.raises(InvalidAdapterError, match="lora_int_id 32 already names adapter 'named'"):
        reg.add(LoRARequest("other", 32, a))
    reg.remove(31)
    engine = reg.resolve(LoRARequest("b", 31, b))
    assert engine.lora_path == b and engine.lora_int_id != 31  # id 31 was issued for a's content


def test_a_refusal_by_one_stage_rolls_back_the_others(tmp_path):
    def refuse(stage, lora):
        return "rank 16 > max_lora_rank 8" if stage == 1 and "new" in lora.lora_path else None

    stages = FakeStages(2, refuse=refuse)
    reg = _registry(stages)
    old = _adapter(tmp_path / "old", b"old")
    assert reg.add(LoRARequest("a", 1, old), stage_id=[0, 1])
    before = {s: dict(v) for s, v in stages.loaded.items()}
    new = _adapter(tmp_path / "new", b"new")
    with pytest.raises(InvalidAdapterError) as info:
        reg.add(LoRARequest("a", 2, new), stage_id=[0, 1])
    assert "adapter 'a'" in str(info.value) and "Stage 1" in str(info.value) and "new" in str(info.value)
    assert "max_lora_rank" in str(info.value)
    assert stages.loaded == before  # stage 0 dropped the new version again; the old one is untouched
    assert reg.get("a").int_id == 1 and reg.by_id(2) is None
    with pytest.raises(InvalidAdapterError):
        reg.add(LoRARequest("b", 3, new), stage_id=[0, 1])
    assert reg.get("b") is None and stages.loaded == before


def test_the_default_target_is_the_entry_stage(tmp_path):
    stages = FakeStages(2, lora_stages=(0,))
    reg = _registry(stages)
    assert reg.add(LoRARequest("a", 1, _adapter(tmp_path / "a", b"a")))
    assert reg.get("a").targets == (0,) and set(stages.loaded[0]) == {1}
    with pytest.raises(LoRANotEnabledError, match="adapter 'b'.*Stage 1"):
        reg.add(LoRARequest("b", 2, _adapter(tmp_path / "b", b"b")), stage_id=1)
    assert reg.get("b") is None


def test_bad_input_names_the_adapter_and_changes_nothing(tmp_path):
    stages = FakeStages(1)
    reg = _registry(stages)
    reg.reserve_names(["base"], "a name of the served model")
    assert reg.add(LoRARequest("a", 1, _adapter(tmp_path / "a", b"a")))
    with pytest.raises(FileNotFoundError, match="adapter 'm'.*no such"):
        reg.add(LoRARequest("m", 2, str(tmp_path / "missing")))
    with pytest.raises(InvalidAdapterError, match="'base': a name of the served model"):
        reg.add(LoRARequest("base", 3, str(tmp_path / "a")))
    with pytest.raises(InvalidAdapterError, match="positive lora_int_id"):
        reg.add("not an adapter")
    assert [r.name for r in reg.records()] == ["a"] and set(stages.loaded[0]) == {1}


def test_concurrent_registrations_of_one_name_have_one_outcome(tmp_path):
    stages = FakeStages(2, delay=0.002)
    reg = _registry(stages)
    paths = [_adapter(tmp_path / f"v{i}", f"weights {i}".encode()) for i in range(4)]
    results: list[bool] = []

    def same():
        results.append(reg.add(LoRARequest("x", 7, paths[0]), stage_id=[0, 1]))

    threads = [threading.Thread(target=same) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]

    def churn(i: int):
        if i % 3 == 2:
            reg.remove_name("y")
        else:
            reg.add(LoRARequest("y", 100 + i % 4, paths[i % 4]), stage_id=[0, 1])

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    record = reg.get("y")
    engine_ids = {reg.get("x").engine.lora_int_id} | ({record.engine.lora_int_id} if record else set())
    for stage in (0, 1):  # the stages hold exactly what the registry says, nothing half-done
        assert set(stages.loaded[stage]) == engine_ids


def test_concurrent_removals_of_one_registration_answer_as_a_serial_history(tmp_path):
    """Issue 46: ten concurrent removals of an adapter registered once: exactly one removes it (the
    HTTP route's 200), the others find no such name (404), as if they had run one after another."""
    stages = FakeStages(2, delay=0.002)
    reg = _registry(stages)
    reg.add(LoRARequest("z", 9, _adapter(tmp_path / "z", b"z")), stage_id=[0, 1])
    barrier = threading.Barrier(10)
    results: list[object] = []

    def remove():
        barrier.wait()
        results.append(reg.remove_name("z"))

    threads = [threading.Thread(target=remove) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.name for r in results if r is not None] == ["z"] and results.count(None) == 9
    assert reg.get("z") is None and stages.loaded == {0: {}, 1: {}}


def test_a_registered_denoiser_is_checked_and_fills_requests_that_name_none(tmp_path):
    """``add(..., denoiser=...)`` (issue 21 rule 3): aliases resolve, a name the target stage lacks is
    refused naming the stage's denoisers and registers nothing, and a request adapter that names no
    denoiser gets the registered one (one that names its own keeps it)."""
    from vllm_omni.lora.request import RequestAdapter

    stages = FakeStages(2)
    denoisers = {0: ("transformer", "transformer_2"), 1: ("transformer",)}
    reg = AdapterRegistry(stages.call, 0, {0: "Stage 0", 1: "Stage 1"}, denoisers=denoisers.get)
    low = LoRARequest("low", 1, _adapter(tmp_path / "low", b"low"))
    with pytest.raises(InvalidAdapterError, match=r"'low'.*unknown denoiser 'middle'"):
        reg.add(low, denoiser="middle")
    with pytest.raises(
        InvalidAdapterError,
        match=r"denoiser 'low_noise' \(transformer_2\) is not one of Stage 1's denoisers \['transformer'\]",
    ):
        reg.add(low, 1, denoiser="low_noise")
    assert reg.list_ids() == set() and stages.loaded == {0: {}, 1: {}}
    assert reg.add(low, denoiser="low_noise") and reg.get("low").denoiser == "transformer_2"
    resolved = reg.resolve_adapter(RequestAdapter(low, scale=0.5))
    assert resolved.denoiser == "transformer_2" and resolved.scale == 0.5
    assert resolved.lora.lora_int_id == reg.get("low").engine.lora_int_id
    assert reg.resolve_adapter(RequestAdapter(low, denoiser="transformer")).denoiser == "transformer"
    other = LoRARequest("other", 2, _adapter(tmp_path / "other", b"other"))  # never registered
    assert reg.resolve_adapter(RequestAdapter(other)).denoiser is None


@pytest.mark.parametrize("step", ["remove_from_stage_0", "add_again_on_stage_0"])
def test_what_a_restart_lost_on_one_stage_stays_until_that_stage_has_it_again(tmp_path, step):
    """A replica of stage 1 lost adapter ``a`` in a restart; removing it from stage 0 or adding it
    again on stage 0 only says nothing about stage 1: it stays ``failed`` there (with the replica)
    when another replica of stage 1 restarts, until stage 1 itself loads it again."""
    stages = FakeStages(2)
    reg = _registry(stages)
    lora = LoRARequest("a", 11, _adapter(tmp_path / "a", b"a1"))
    assert reg.add(lora, stage_id=[0, 1])
    engine_id = reg.get("a").engine.lora_int_id
    reg.note_restart(1, {engine_id: "replica 0: files gone"}, replica=0)
    if step == "remove_from_stage_0":
        assert reg.remove(11, stage_id=0)
    else:
        reg.add(lora, stage_id=0)
    reg.note_restart(1, {}, replica=1)  # the other replica restarts and restores everything
    state = reg.by_id(11).stages[1]
    assert (state.state, state.failed_replicas, state.error) == ("failed", (0,), "replica 0: files gone")
    assert reg.failed() == {1: {11: "replica 0: files gone"}}
    reg.add(lora, stage_id=1)  # stage 1 has it again
    assert reg.by_id(11).stages[1].state == "loaded" and reg.failed() == {}
