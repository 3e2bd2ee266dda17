"""Every file read for a request adapter resolves inside ``--lora-dirs`` (issue 13, item 8), and the
adapter scale has one limit on the HTTP and the Python paths (item 15, first sentence)."""

from __future__ import annotations

import shutil

import pytest

from tests.lora.fake_stages import FakeStages
from vllm_omni.entrypoints.openai.lora import LoRASpec, ServerAdapters, parse_lora_field
from vllm_omni.errors import InvalidRequestError, OpenAIError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.registry import AdapterRegistry
from vllm_omni.lora.request import MAX_ADAPTER_SCALE, LoRARequest, RequestAdapter, validate_request_adapters


@pytest.fixture
def roots(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    for folder in (root / "real", outside):
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_bytes(b"")
    return root, outside


@pytest.mark.parametrize("linked", ["adapter_model.safetensors", "adapter_config.json"])
def test_a_file_symlinked_out_of_an_allowed_folder_is_refused(roots, linked):
    root, outside = roots
    folder = root / "linked"
    shutil.copytree(root / "real", folder)
    (folder / linked).unlink()
    (folder / linked).symlink_to(outside / linked)
    registry = ServerAdapters(AdapterRegistry(FakeStages().call), [str(root)], False, ["base"])
    with pytest.raises(OpenAIError) as info:
        registry.to_request(LoRASpec("x", str(folder)))
    assert info.value.status == 400 and info.value.param == "lora"
    assert str(folder / linked) in info.value.message and str(outside) not in info.value.message
    # a file symlinked inside the root is fine; so is a sibling config of a single file inside it
    (folder / linked).unlink()
    (folder / linked).symlink_to(root / "real" / linked)
    assert registry.to_request(LoRASpec("x", str(folder))).lora_path == str(folder)


def test_a_single_file_whose_sibling_config_leads_outside_is_refused(roots):
    root, outside = roots
    (root / "single").mkdir()
    (root / "single" / "one.safetensors").write_bytes(b"")
    (root / "single" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    registry = ServerAdapters(AdapterRegistry(FakeStages().call), [str(root)], False, ["base"])
    with pytest.raises(OpenAIError, match="adapter_config.json") as info:
        registry.to_request(LoRASpec("x", str(root / "single" / "one.safetensors")))
    assert info.value.status == 400


@pytest.mark.parametrize("scale", [MAX_ADAPTER_SCALE * 1.5, -1e6, 1e6])
def test_one_scale_limit_on_every_path(scale):
    lora = LoRARequest("a", 1, "/adapters/a")
    with pytest.raises(OpenAIError) as http:
        parse_lora_field({"path": "/p", "scale": scale})
    assert http.value.status == 400 and f"{MAX_ADAPTER_SCALE:g}" in http.value.message
    with pytest.raises(
        InvalidRequestError, match=rf"lora_scales\[0\] must be a finite number in .*{MAX_ADAPTER_SCALE:g}"
    ):
        OmniDiffusionSamplingParams(lora_requests=[lora], lora_scales=[scale])
    with pytest.raises(InvalidRequestError, match=f"{MAX_ADAPTER_SCALE:g}"):
        validate_request_adapters([RequestAdapter(lora, scale)])
    for ok in (MAX_ADAPTER_SCALE, -MAX_ADAPTER_SCALE, 0.0):
        assert parse_lora_field({"path": "/p", "scale": ok})[0].scale == ok
        assert OmniDiffusionSamplingParams(lora_requests=[lora], lora_scales=[ok]).adapters[0].scale == ok


def _folder(path, weights: bytes):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


@pytest.mark.parametrize("swap", ["folder", "file"])
def test_files_are_checked_at_every_read_reload_request_and_restart(tmp_path, swap):
    """Issue 35 rule 5: an adapter registered from inside a root whose folder (or weights file) is later
    replaced by a symlink leading out is refused at reload, at a request that finds its files changed and
    at a worker restart, naming the path; nothing outside is read, the loaded version stays registered
    and loaded, and serves again once the files are back (a cache miss on a stage would re-read the
    files, so a request is never answered from the old version while they lead out)."""
    from vllm_omni.engine.workers.lora_journal import replay_adapters
    from vllm_omni.errors import AdapterFileNotAllowedError
    from vllm_omni.lora.allow_list import RefusedRestore

    root, outside = tmp_path / "root", _folder(tmp_path / "outside", b"v2 outside")
    attn = _folder(root / "attn", b"v1")
    trusted = _folder(tmp_path / "startup", b"startup")  # --lora-modules: trusted where it is
    stages = FakeStages()
    reg = ServerAdapters(AdapterRegistry(stages.call), [str(root)], False, ["base"])
    lora = LoRARequest("attn", 7, reg.resolve_path(str(attn)))
    reg.core.add(lora)
    reg.core.add(LoRARequest("startup", 8, reg.register_startup_path(str(trusted))))
    loaded = reg.core.get("attn").engine
    if swap == "folder":
        shutil.move(attn, tmp_path / "attn_moved")
        attn.symlink_to(outside, target_is_directory=True)
        named = str(attn)
    else:
        (attn / "adapter_model.safetensors").unlink()
        (attn / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
        named = str(attn / "adapter_model.safetensors")
    calls = len(stages.calls)
    with pytest.raises(AdapterFileNotAllowedError) as info:  # reload (Python / load_inplace)
        reg.core.add(lora, reload=True)
    assert named in str(info.value) and "--lora-dirs" in str(info.value)
    assert reg.core.get("attn").engine == loaded and reg.core.get("attn").version == 1
    # a request naming it: the files changed, so they would be read; refused the same way
    with pytest.raises(AdapterFileNotAllowedError, match=named):
        reg.core.resolve(reg.lookup("attn"))
    assert len(stages.calls) == calls and stages.loaded[0][loaded.lora_int_id] == loaded  # nothing read
    # a restarted worker is told not to read it (the restart reports it as not restored)
    expected = dict((r.lora_name, r) for r, _ in reg.core.expected_on(0))
    assert isinstance(expected["attn"], RefusedRestore) and named in expected["attn"].refusal
    assert not isinstance(expected["startup"], RefusedRestore)
    added = []
    failed = replay_adapters(list(expected.values()), [], lambda m, r: added.append(r.lora_name))
    assert added == ["startup"] and named in str(failed[loaded.lora_int_id])
    with pytest.raises(OpenAIError) as http:  # the HTTP load_inplace path refuses it too
        reg.resolve_path(str(attn))
    assert http.value.status == 400
    # the files come back: the loaded version serves again, nothing was reloaded
    if swap == "folder":
        attn.unlink()
        shutil.move(tmp_path / "attn_moved", attn)
        assert reg.core.resolve(reg.lookup("attn")) == loaded
        assert len(stages.calls) == calls and reg.core.expected_on(0)[0][0] == loaded
