"""A name is a version on a real LLM stage (issue 21, rule 1): registering a name again with other
weights never serves state of the old ones, not even from vLLM's prefix cache.

vLLM keys cached KV blocks by the adapter's lora name and path. Before the registry, removing an
adapter, rewriting its files and adding it again under the same name, id and path made a prompt of a
few hundred tokens reuse the old adapter's KV (tokens of neither adapter). Every output here is
compared token for token with transformers+peft on the weights that are on disk at that moment.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vllm import SamplingParams

from tests.llm_reference import hf_greedy
from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.request import LoRARequest

N = 6
PROMPT_IDS = [10 + (i * 37) % 480 for i in range(300)]  # ~300 tokens: several full prefix-cache blocks

pytestmark = pytest.mark.engine


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


def _copy_over(src: Path, dst: Path) -> None:
    """Rewrite the adapter folder ``dst`` in place with ``src``'s files (same path, new content)."""
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(src / name, dst / name)


@pytest.fixture(scope="module")
def omni(tiny_llm_assets):
    from vllm_omni import Omni

    engine = Omni(
        str(tiny_llm_assets.model_dir),
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        enable_prefix_caching=True,
        max_model_len=512,
        dtype="float32",
        max_num_seqs=4,
    )
    yield engine
    engine.shutdown()


def test_a_rewritten_adapter_never_serves_the_old_weights(omni, tiny_llm_assets, tmp_path):
    model, a, b = tiny_llm_assets.model_dir, tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_b
    ref_a, ref_b = hf_greedy(model, PROMPT_IDS, N, a), hf_greedy(model, PROMPT_IDS, N, b)
    assert ref_a != ref_b
    path = tmp_path / "v"
    shutil.copytree(a, path)
    lora = LoRARequest("v", 1, str(path))
    assert omni.add_lora(lora)
    assert omni.generate(PROMPT_IDS, greedy(), lora_request=lora)[0].token_ids == ref_a
    # remove, rewrite the files at the same path, add again under the same name and id
    assert omni.remove_lora(1)
    _copy_over(b, path)
    assert omni.add_lora(lora)
    assert omni.list_loras() == {1}
    assert omni.generate(PROMPT_IDS, greedy(), lora_request=lora)[0].token_ids == ref_b
    # rewritten again with no call at all: the next request gets what is on disk
    _copy_over(a, path)
    assert omni.generate(PROMPT_IDS, greedy(), lora_request=lora)[0].token_ids == ref_a
    assert omni.adapter_registry.get("v").version == 2 and omni.list_loras() == {1}
    # reload=True (HTTP load_inplace) with unchanged files changes nothing
    assert omni.add_lora(lora, reload=True) is False


def test_a_new_path_under_a_registered_name_is_a_new_version(omni, tiny_llm_assets, tmp_path):
    model, a, b = tiny_llm_assets.model_dir, tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_b
    first, second = shutil.copytree(a, tmp_path / "first"), shutil.copytree(b, tmp_path / "second")
    assert omni.add_lora(LoRARequest("w", 21, str(first)))
    assert omni.generate(PROMPT_IDS, greedy(), lora_request=LoRARequest("w", 21, str(first)))[
        0
    ].token_ids == (hf_greedy(model, PROMPT_IDS, N, a))
    assert omni.add_lora(LoRARequest("w", 22, str(second)))  # same name, new path: replaces it
    assert 21 not in omni.list_loras() and 22 in omni.list_loras()
    out = omni.generate(PROMPT_IDS, greedy(), lora_request=LoRARequest("w", 22, str(second)))[0].token_ids
    assert out == hf_greedy(model, PROMPT_IDS, N, b)
    # the old id is free again only for its own files; a refused id changes nothing
    with pytest.raises(InvalidAdapterError, match="lora_int_id 22 already names adapter 'w'"):
        omni.add_lora(LoRARequest("other", 22, str(first)))
    assert omni.adapter_registry.get("w").int_id == 22 and omni.remove_lora(22)


def test_an_update_with_every_slot_pinned_is_refused_and_the_old_version_serves(
    omni, tiny_llm_assets, tmp_path
):
    """Issue 35 item 7: with as many pinned adapters as vLLM's cache holds (``max_cpu_loras`` 2), a new
    version of one of them (files rewritten in place) has no room. A reload used to raise vLLM's bare
    ``All items are pinned ...`` and every later request naming the adapter failed with it; now the
    reload is refused naming the adapter, the stage and the limits, and requests keep getting the loaded
    version (transformers+peft on the old files). Once there is room, a reload serves the new files."""
    from vllm_omni.errors import AdapterUpdateRefusedError

    model, a, b = tiny_llm_assets.model_dir, tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_b
    for record in omni.adapter_registry.records():
        omni.remove_lora(record.int_id)
    p, q = LoRARequest("p", 31, str(shutil.copytree(a, tmp_path / "p"))), LoRARequest("q", 32, str(b))
    for lora in (p, q):
        assert omni.add_lora(lora) and omni.pin_lora(lora.lora_int_id)
    _copy_over(b, tmp_path / "p")
    ref_a = hf_greedy(model, PROMPT_IDS, N, a)
    assert omni.generate(PROMPT_IDS, greedy(), lora_request=p)[0].token_ids == ref_a
    with pytest.raises(
        AdapterUpdateRefusedError, match=r"'p'.*Stage 0.*pinned \(p, q; max_cpu_loras=2"
    ) as info:
        omni.add_lora(p, reload=True)
    assert "All items are pinned" not in str(info.value) and "version 1 of 'p' keeps serving" in str(
        info.value
    )
    assert omni.generate(PROMPT_IDS, greedy(), lora_request=p)[0].token_ids == ref_a
    assert omni.list_loras() == {31, 32} and omni.adapter_registry.get("p").version == 1
    assert omni.remove_lora(32)  # room: the next request naming p gets the files on disk
    assert omni.generate(PROMPT_IDS, greedy(), lora_request=p)[0].token_ids == hf_greedy(
        model, PROMPT_IDS, N, b
    )
    assert omni.add_lora(p, reload=True) is False  # that version is registered already
    assert omni.list_loras() == {31} and omni.adapter_registry.get("p").version == 2
    stats = omni.stage_stats()[0].adapters["p"]  # item 6: the name stays loaded and pinned across versions
    assert (stats.loaded, stats.pinned) == (True, True)
    assert omni.remove_lora(31)


def test_a_folder_rewritten_in_place_never_reaches_a_request_bound_to_its_loaded_version(
    omni, tiny_llm_assets, tmp_path
):
    """Issue 46: vLLM reads an adapter's safetensors mapped and keeps the tensors without a copy, and
    loads an evicted adapter again from its path. A trainer saving its next checkpoint over the served
    folder (truncated, half written, then complete) must not change what requests bound to the loaded
    version get (queued while the folder changes, running, or loaded again after an eviction), and must
    not take the stage down; the next request through the registry gets the new files."""
    from tests.waiting import wait_until
    from vllm_omni.inputs.stage_request import StageRequest
    from vllm_omni.lora.request import RequestAdapters

    model, a, b = tiny_llm_assets.model_dir, tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_b
    ref_a, ref_b = hf_greedy(model, PROMPT_IDS, N, a), hf_greedy(model, PROMPT_IDS, N, b)
    path = shutil.copytree(a, tmp_path / "served")
    weights = path / "adapter_model.safetensors"
    lora = LoRARequest("served", 41, str(path))
    assert omni.add_lora(lora)
    bound = omni.adapter_registry.get("served").engine  # what requests bound to version 1 carry
    runtime = omni._orchestrator.runtimes[0]

    def submit(max_tokens: int = N):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return runtime.submit(StageRequest(PROMPT_IDS, params, RequestAdapters.of(bound)))

    running = submit(40)
    wait_until(lambda: any(i.future is running for i in list(runtime._running.values())), "a running request")
    new_bytes = (b / "adapter_model.safetensors").read_bytes()
    weights.write_bytes(b"")  # the trainer's save truncates first
    assert running.result(timeout=600).outputs[0].token_ids[:N] == ref_a
    # two other adapters take vLLM's two cache entries: version 1 must be loaded again for what follows
    for other in (LoRARequest("x", 42, str(a)), LoRARequest("y", 43, str(b))):
        omni.generate(PROMPT_IDS, greedy(), lora_request=other)
    assert bound.lora_int_id not in runtime._engine.list_loras()
    with runtime.hold():
        queued = [submit() for _ in range(3)]
        weights.write_bytes(new_bytes[: len(new_bytes) // 2])  # half written
    assert [f.result(timeout=600).outputs[0].token_ids for f in queued] == [ref_a] * 3
    with pytest.raises(InvalidAdapterError, match="adapter_model.safetensors"):
        omni.generate(PROMPT_IDS, greedy(), lora_request=lora)  # the half-written files are refused
    _copy_over(b, path)
    assert omni.generate(PROMPT_IDS, greedy(), lora_request=lora)[0].token_ids == ref_b
    assert omni.adapter_registry.get("served").version == 2
    for int_id in (41, 42, 43):
        omni.remove_lora(int_id)
