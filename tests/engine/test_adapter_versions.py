"""A name is a version on a real LLM stage (issue 21, rule 1): registering a name again with other
weights never serves state of the old ones, not even from vLLM's prefix cache.

vLLM keys cached KV blocks by the adapter's lora name and path. Before the registry, removing an
adapter, rewriting its files and adding it again under the same name, id and path made a prompt of a
few hundred tokens reuse the old adapter's KV (tokens of neither adapter). Every output here is
compared token for token with transformers+peft on the weights that are on disk at that moment.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from vllm import SamplingParams

from tests.llm_reference import hf_greedy
from tests.waiting import wait_until
from vllm_omni.errors import InvalidAdapterError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest, RequestAdapters

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
        max_loras=1,  # and max_cpu_loras 1: the RL rollout set-up (one slot, pinned in one test)
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


def test_a_pinned_adapter_updates_in_place_with_every_slot_pinned(omni, tiny_llm_assets, tmp_path):
    """Issues 35 / 46, the RL rollout set-up: ``max_loras=1, max_cpu_loras=1`` and the one adapter pinned.
    Five updates (files rewritten, ``add_lora(reload=True)``) during a stream of requests: each new
    version is validated off-slot, then swapped into the slot the old one holds once the old one's
    running request is done. Every request equals one version's transformers+peft tokens (never a mix,
    never an error), a request running when an update starts finishes on its version, a request sent
    after an update returns gets the new one; a refused version leaves the old one serving, pinned."""
    from safetensors.torch import load_file, save_file

    model, a = tiny_llm_assets.model_dir, tiny_llm_assets.adapter_a
    for record in omni.adapter_registry.records():
        omni.remove_lora(record.int_id)
    # two versions with one config (a trainer's steps): a's weights, and a's with lora_B negated
    neg = shutil.copytree(a, tmp_path / "neg")
    tensors = load_file(a / "adapter_model.safetensors")
    save_file({k: -v if "lora_B" in k else v for k, v in tensors.items()}, neg / "adapter_model.safetensors")
    dirs = {"a": a, "b": neg}
    refs = {k: hf_greedy(model, PROMPT_IDS, N, d) for k, d in dirs.items()}
    assert refs["a"] != refs["b"]
    path = shutil.copytree(a, tmp_path / "p")
    p = LoRARequest("p", 31, str(path))
    assert omni.add_lora(p) and omni.pin_lora(31)
    runtime = omni._orchestrator.runtimes[0]
    outputs: list[list[int]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def save(version: str) -> None:
        """The trainer's save: the weights written beside, then renamed over the served file."""
        tmp = path / "adapter_model.safetensors.tmp"
        shutil.copyfile(dirs[version] / "adapter_model.safetensors", tmp)
        os.replace(tmp, path / "adapter_model.safetensors")

    def stream():
        while not stop.is_set():
            try:
                outputs.append(list(omni.generate(PROMPT_IDS, greedy(), lora_request=p)[0].token_ids))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    streamer = threading.Thread(target=stream)
    streamer.start()
    try:
        for version in range(1, 6):
            old, new = ("a", "b") if version % 2 else ("b", "a")
            bound = RequestAdapters.of(omni.adapter_registry.get("p").engine)
            long = runtime.submit(
                StageRequest(
                    PROMPT_IDS, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), bound
                )
            )
            wait_until(lambda f=long: any(i.future is f for i in list(runtime._running.values())), "running")
            save(new)
            omni.add_lora(p, reload=True)  # waits for the running request of the old version (or no-op:
            # a request of the stream saw the new files first and registered them)
            assert long.result(timeout=600).outputs[0].token_ids[:N] == refs[old], f"update {version}"
            assert omni.generate(PROMPT_IDS, greedy(), lora_request=p)[0].token_ids == refs[new]
            assert omni.adapter_registry.get("p").version == 1 + version
            assert omni.list_loras() == {31} and len(runtime._engine.list_loras()) == 1
    finally:
        stop.set()
        streamer.join()
    assert errors == [] and len(outputs) >= 5
    assert all(out in refs.values() for out in outputs)
    # a version the stage refuses: the old one keeps serving, pinned
    rank64 = tiny_llm_assets.adapter_rank64
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(rank64 / name, path / name)
    with pytest.raises(InvalidAdapterError):
        omni.add_lora(p, reload=True)
    record = omni.adapter_registry.get("p")
    assert record.version == 6 and runtime._engine.list_loras() == {record.engine.lora_int_id}
    kept = runtime.submit(StageRequest(PROMPT_IDS, greedy(), RequestAdapters.of(record.engine)))
    assert kept.result(timeout=600).outputs[0].token_ids == refs["b"]  # version 5's weights
    stats = omni.stage_stats()[0].adapters["p"]
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


def test_evicted_folders_beyond_the_held_ones_are_read_again_and_checked(omni, tiny_llm_assets, tmp_path):
    """A stage keeps the bytes of a few evicted folders only (request-time adapters must not accumulate);
    one whose bytes it let go is read again when used again: the same content serves (== peft), other
    content under the old id is refused naming it (the registry gives new files a new id)."""
    from vllm_omni.engine import llm_held_adapters

    model, a, b = tiny_llm_assets.model_dir, tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_b
    runtime = omni._orchestrator.runtimes[0]
    folders = [shutil.copytree(a, tmp_path / f"f{i}") for i in range(llm_held_adapters.HELD_EVICTED + 2)]
    bound = []
    short = PROMPT_IDS[:8]
    for i, folder in enumerate(folders):  # each evicts the one before (one cache entry)
        omni.generate(short, greedy(), lora_request=LoRARequest(f"f{i}", 60 + i, str(folder)))
        bound.append(omni.adapter_registry.by_id(60 + i).engine)
    assert (
        len(runtime._held_files) <= llm_held_adapters.HELD_EVICTED + 1
        and bound[0].lora_int_id in runtime._let_go
    )
    first = runtime.submit(StageRequest(short, greedy(), RequestAdapters.of(bound[0])))
    assert first.result(timeout=600).outputs[0].token_ids == hf_greedy(model, short, N, a)  # read again: same
    _copy_over(b, folders[1])
    changed = runtime.submit(StageRequest(short, greedy(), RequestAdapters.of(bound[1])))
    with pytest.raises(InvalidAdapterError, match="files changed since this version was loaded"):
        changed.result(timeout=600)
    for i in range(len(folders)):
        omni.remove_lora(60 + i)
    assert not runtime._held_files and not runtime._let_go
