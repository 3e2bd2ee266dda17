"""The ``lora`` request field parser and the adapter-path allow-list (no server, no engine)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from tests.entrypoints.lora_strategies import lora_values
from tests.lora.fake_stages import FakeStages
from vllm_omni.entrypoints.openai.lora import LoRASpec, ServerAdapters, parse_lora_field
from vllm_omni.errors import OpenAIError
from vllm_omni.lora.registry import AdapterRegistry
from vllm_omni.lora.request import LoRARequest, stable_lora_int_id


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "peft").mkdir(parents=True)
    (root / "peft" / "adapter_config.json").write_text("{}")
    (root / "peft" / "adapter_model.safetensors").write_bytes(b"")
    (root / "single.safetensors").write_bytes(b"")
    (root / "weights.ckpt").write_bytes(b"")
    (root / "pickled").mkdir()
    (root / "pickled" / "adapter_model.bin").write_bytes(b"")
    outside = tmp_path / "outside"
    (outside / "peft").mkdir(parents=True)
    (outside / "peft" / "adapter_config.json").write_text("{}")
    (outside / "peft" / "adapter_model.safetensors").write_bytes(b"")
    (root / "link_out").symlink_to(outside / "peft", target_is_directory=True)
    (root / "link_in").symlink_to(root / "peft", target_is_directory=True)
    return root, outside


def registry(root, **kw):
    return ServerAdapters(
        AdapterRegistry(FakeStages().call), [str(root)], kw.get("allow_remote", False), ["base"]
    )


def status_of(fn) -> int:
    with pytest.raises(OpenAIError) as info:
        fn()
    return info.value.status


def test_object_list_and_aliases():
    assert parse_lora_field(None) == [] and parse_lora_field([]) == []
    one = parse_lora_field({"name": "s", "path": "/p"})
    assert one == [LoRASpec("s", "/p", None, None)]
    many = parse_lora_field(
        [{"lora_name": "s", "local_path": "/p", "scale": 0.5, "int_id": 7}, {"path": "/q"}]
    )
    assert many == [LoRASpec("s", "/p", 0.5, 7), LoRASpec(None, "/q", None, None)]


@pytest.mark.parametrize(
    "peer",
    [
        {"adapter": "s", "lora_scale": 0.5},  # vllm-omni
        {"lora_name": "s", "strength": 0.5},  # vLLM's name, ComfyUI's scale
        {"name": "s", "weight": 0.5},  # A1111
        {"adapter": "s", "scale": {"steps": 0.5}},
    ],
)
def test_peer_spellings_parse_as_the_canonical_keys(peer):
    canonical = parse_lora_field({"name": "s", "scale": 0.5})
    parsed = parse_lora_field(peer)
    assert parsed[0].name == canonical[0].name == "s"
    scale = parsed[0].scale
    assert (scale.steps if not isinstance(scale, float) else scale) == canonical[0].scale == 0.5


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"name": "s", "adapter": "t"}, "'name' and 'adapter' are spellings of the same field 'name'"),
        ({"name": "s", "scale": 1, "strength": 1}, "'scale' and 'strength' are spellings of the same field"),
        ({"name": "s", "lora_scale": 1, "weight": 2}, "'lora_scale' and 'weight' are spellings"),
        ({"name": "s", "strenght": 0.5}, "unknown key(s) 'strenght' (did you mean 'strength'?)"),
        ({"name": "s", "lora_sacle": 0.5}, "'lora_sacle' (did you mean 'lora_scale'?)"),
        ({"name": "s", "zzz": 0.5}, "unknown key(s) 'zzz'; allowed keys: ['name', 'lora_name', 'adapter'"),
        ({"name": "s", "scale": {}}, "lora.scale is an empty schedule"),
        ({"name": "s", "weight": []}, "lora.scale must hold 1 to 1000 entries, got 0"),
        ({"name": "s", "strength": {"steps": []}}, "lora.scale.steps must hold 1 to 1000 entries"),
    ],
)
def test_spelling_refusals_name_the_keys(value, message):
    with pytest.raises(OpenAIError) as info:
        parse_lora_field(value)
    assert info.value.status == 400 and info.value.param == "lora"
    assert message in info.value.message


def test_a1111_prompt_tokens(caplog):
    from vllm_omni.entrypoints.openai.lora import prompt_lora_syntax

    prompt = "<lora:style> a red cat, <lora:detail:-0.5>on a mat"
    got = prompt_lora_syntax(prompt, {"name": "own", "scale": 0.2}, True)
    assert got == (
        "a red cat, on a mat",
        [{"name": "own", "scale": 0.2}, {"name": "style", "scale": 1.0}, {"name": "detail", "scale": -0.5}],
    )
    assert prompt_lora_syntax("a cat", None, True) == ("a cat", None)
    with caplog.at_level("WARNING"):
        assert prompt_lora_syntax(prompt, None, False) == (prompt, None)  # off: the text is the prompt
    warnings = [r for r in caplog.records if "--prompt-lora-syntax" in r.getMessage()]
    assert len(warnings) == 1 and "'<lora:style:...>'" in warnings[0].getMessage()
    for bad, message in (
        ("a <lora:s:x>", "the weight must be a number"),
        ("a <lora::1>", "names no adapter"),
    ):
        with pytest.raises(OpenAIError, match=message) as info:
            prompt_lora_syntax(bad, None, True)
        assert info.value.status == 400 and info.value.param == "prompt"


@pytest.mark.parametrize(
    "value",
    [
        "s",
        3,
        [1],
        {"name": "s", "path": "/p", "alpha": 2},
        {"name": "s", "lora_name": "t", "path": "/p"},
        {"path": "/p", "local_path": "/q"},
        {"scale": 1.0},
        {"path": ""},
        {"path": 5},
        {"path": "/p", "scale": True},
        {"path": "/p", "scale": float("nan")},
        {"path": "/p", "scale": float("inf")},
        {"path": "/p", "scale": 1e6},
        {"path": "/p", "int_id": 0},
        {"path": "/p", "int_id": 2**31},
        {"path": "/p", "int_id": 1.5},
        [{"path": "/p"}] * 3,
    ],
)
def test_malformed_values_are_400(value):
    with pytest.raises(OpenAIError) as info:
        parse_lora_field(value, max_items=2)
    assert info.value.status == 400 and info.value.param == "lora"


def test_allow_list_uses_realpath_containment(tree):
    root, outside = tree
    reg = registry(root)
    peft = reg.to_request(LoRASpec("p", str(root / "peft")))
    assert peft.lora_path == str(root / "peft") and peft.lora_int_id == stable_lora_int_id(str(root / "peft"))
    assert reg.to_request(LoRASpec("s", str(root / "single.safetensors"))).lora_name == "s"
    # a symlink staying inside the root resolves to the same adapter (same id)
    assert reg.to_request(LoRASpec("p", str(root / "link_in"))).lora_int_id == peft.lora_int_id
    refused = [
        str(root / "link_out"),
        str(root / ".." / "outside" / "peft"),
        str(outside / "peft"),
        str(outside / "missing"),
        str(root) + "-sibling/peft",
        "relative/peft",
        "org/name",
        "https://host/x.safetensors",
    ]
    for path in refused:
        with pytest.raises(OpenAIError) as info:
            reg.to_request(LoRASpec("x", path))
        assert info.value.status == 400 and str(outside) not in info.value.message.replace(path, "")
    # existing and missing outside targets get the same words
    with pytest.raises(OpenAIError) as a:
        reg.resolve_path(str(outside / "peft"))
    with pytest.raises(OpenAIError) as b:
        reg.resolve_path(str(outside / "nope"))
    assert a.value.message.replace(str(outside / "peft"), "") == b.value.message.replace(
        str(outside / "nope"), ""
    )


def test_pickle_only_and_missing_adapters_are_refused(tree):
    root, _ = tree
    reg = registry(root)
    for name in ("pickled", "weights.ckpt"):
        with pytest.raises(OpenAIError) as info:
            reg.resolve_path(str(root / name))
        assert "pickle" in info.value.message
    assert status_of(lambda: reg.resolve_path(str(root / "absent"))) == 400


def test_startup_paths_are_allowed_outside_the_roots(tree):
    root, outside = tree
    reg = ServerAdapters(AdapterRegistry(FakeStages().call), [], False, ["base"])
    assert status_of(lambda: reg.resolve_path(str(root / "peft"))) == 400
    reg.register_startup_path(str(outside / "peft"))
    assert reg.resolve_path(str(outside / "peft")) == str(outside / "peft")


def test_ids_never_switch_weights_and_names_resolve(tree):
    root, _ = tree
    reg = registry(root)
    reg.core.resolve(reg.to_request(LoRASpec("x", str(root / "peft"), int_id=9)))  # as the engine does
    assert status_of(lambda: reg.to_request(LoRASpec("x", str(root / "single.safetensors"), int_id=9))) == 400
    # same name, other path: another id
    a = reg.to_request(LoRASpec("y", str(root / "peft")))
    b = reg.to_request(LoRASpec("y", str(root / "single.safetensors")))
    assert a.lora_int_id != b.lora_int_id
    reg.core.add(LoRARequest("known", 77, str(root / "peft")))
    assert reg.to_request(LoRASpec("known", None)).lora_int_id == 77
    assert status_of(lambda: reg.to_request(LoRASpec("unknown", None))) == 404


def test_remote_needs_the_flag(tree, monkeypatch):
    root, _ = tree
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "--allow-remote-lora" in _message(lambda: registry(root).resolve_path("org/name"))
    remote = registry(root, allow_remote=True)
    # allowed, but nothing can be fetched offline: still a 400, never a crash
    assert status_of(lambda: remote.resolve_path("org/name")) == 400
    assert status_of(lambda: remote.resolve_path("ftp://host/x")) == 400


def _message(fn) -> str:
    with pytest.raises(OpenAIError) as info:
        fn()
    return info.value.message


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=lora_values())
def test_property_parser_only_raises_client_errors(tmp_path_factory, value):
    root = tmp_path_factory.getbasetemp() / "prop_root"
    os.makedirs(root, exist_ok=True)
    reg = registry(root)
    try:
        for spec in parse_lora_field(value, max_items=4):
            reg.to_request(spec)
    except OpenAIError as exc:
        assert exc.status in (400, 404), exc.message
        assert exc.message
