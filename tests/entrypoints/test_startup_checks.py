"""Start-up mistakes are refused at once, naming the input, before vLLM is imported (issue 23 item 4).

The refusals run in one child process through the real ``main``; that vLLM and torch were never
imported there proves no engine could have started. How long a refusal takes is measured by
``benchmarks/startup_checks.py`` (a benchmark, not a timed test).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.entrypoints.server_utils import server_env
from vllm_omni.entrypoints.cli.preflight import check_argv, parse_lora_module
from vllm_omni.errors import ConfigError

PROBE = """
import json, sys, time
from vllm_omni.entrypoints.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    t = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    results.append({"code": code, "seconds": time.perf_counter() - t})
    print("--- end of case", file=sys.stderr, flush=True)
print(json.dumps({"results": results, "vllm": "vllm" in sys.modules, "torch": "torch" in sys.modules}))
"""


@pytest.fixture
def bad_inputs(tmp_path, tiny_llm_assets):
    """(argv, expected message) pairs, one start-up mistake each, and a held port."""
    model = str(tiny_llm_assets.model_dir)
    adapter = str(tiny_llm_assets.adapter_a)
    (tmp_path / "bad.yaml").write_text("stages:\n  - stage_id: 0\n    max_lora_rank: [8\n")
    (tmp_path / "list.yaml").write_text("- stage_id: 0\n")
    (tmp_path / "file.txt").write_text("not a folder\n")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    missing = tmp_path / "missing"
    cases = [
        (["--lora-modules", f"a={missing}"], f"--lora-modules a={missing}: no such file or directory"),
        (["--lora-modules", f"a={adapter}", f"b={missing}", "--dry-run"], f"--lora-modules b={missing}: no such"),
        (["--lora-modules", json.dumps({"name": "c", "path": str(missing)})], "no such file or directory"),
        (["--lora-path", "rel/nope.safetensors"], "--lora-path rel/nope.safetensors: no such file or directory"),
        (["--lora-dirs", str(tmp_path / "file.txt")], f"--lora-dirs {tmp_path / 'file.txt'}: not a directory"),
        (["--deploy-config", str(tmp_path / "bad.yaml")], f"--deploy-config {tmp_path / 'bad.yaml'}: not valid YAML"),
        (["--deploy-config", str(tmp_path / "list.yaml")], "must be a mapping with a 'stages:' list, got list"),
        (["--deploy-config", str(missing)], f"--deploy-config {missing}: cannot read it"),
        (["--host", "127.0.0.1", "--port", str(port)], f"--port {port}: cannot listen on 127.0.0.1:{port}: "
         "address already in use"),
    ]  # fmt: skip
    if os.getuid() != 0:  # root reads everything
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0)
        cases.append((["--lora-dirs", str(locked)], f"--lora-dirs {locked}: permission denied"))
    yield [(["serve", model, *flags], message) for flags, message in cases]
    held.close()


def test_refused_before_vllm_is_imported(bad_inputs, tmp_path):
    argvs = [argv for argv, _ in bad_inputs]
    env = server_env(VLLM_OMNI_CACHE_ROOT=str(tmp_path / "cache"))  # a cold cache: preflight needs none
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = proc.stderr.split("--- end of case\n")
    for (argv, message), result, err in zip(bad_inputs, report["results"], errors):
        assert result["code"] == 2, (argv, err)
        assert err.startswith("vllm-omni serve: error: ") and message in err, (argv, err)
        assert err.count("\n") == 1, f"one line, no traceback: {err!r}"
    assert (report["vllm"], report["torch"]) == (False, False), "an input check imported the engine"


def test_full_parser_gives_the_same_errors_and_resolves_paths(tiny_llm_assets, tmp_path, monkeypatch):
    """Callers of ``parse_serve_argv`` (no fast path) get the same refusals; relative paths come
    back absolute, once, so later ``cwd`` changes and request paths see one spelling."""
    from vllm_omni.entrypoints.cli.serve import parse_serve_argv

    model = str(tiny_llm_assets.model_dir)
    with pytest.raises(ConfigError, match=r"--lora-modules a=nowhere: no such file or directory"):
        parse_serve_argv([model, "--lora-modules", "a=nowhere"])
    (tmp_path / "not_an_adapter").mkdir()
    with pytest.raises(
        ConfigError,
        match=r"--lora-modules b=.*not_an_adapter: missing adapter_config.json and adapter_model.safetensors",
    ):
        parse_serve_argv([model, "--lora-modules", f"b={tmp_path / 'not_an_adapter'}"])
    link = tmp_path / "adapters"
    link.symlink_to(tiny_llm_assets.adapter_a.parent, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    rel = f"adapters/{tiny_llm_assets.adapter_a.name}"
    launch, settings = parse_serve_argv(
        [model, "--lora-modules", f"a={rel}", "--lora-dirs", "adapters", "--deploy-config", "d.yaml"]
    )
    real = os.path.realpath(tiny_llm_assets.adapter_a)
    assert settings.lora_modules == [("a", real)]
    assert settings.lora_dirs == [os.path.realpath(tiny_llm_assets.adapter_a.parent)]
    assert launch.deploy_config == str(tmp_path / "d.yaml")


def test_relative_lora_path_is_the_adapter_requests_name(tiny_llm_assets, tmp_path, monkeypatch):
    """A relative ``--lora-path`` and a request naming the same adapter by its absolute path get one
    id and one location (they clashed on an ``int_id`` the client never sent)."""
    from tests.lora.fake_stages import FakeStages
    from vllm_omni.entrypoints.openai.lora import LoRASpec, ServerAdapters
    from vllm_omni.lora.registry import AdapterRegistry
    from vllm_omni.lora.request import startup_lora_request

    monkeypatch.chdir(tiny_llm_assets.adapter_a.parent)
    startup = startup_lora_request(tiny_llm_assets.adapter_a.name)
    registry = ServerAdapters(AdapterRegistry(FakeStages().call), [], False, ["base"])
    registry.register_startup_path(tiny_llm_assets.adapter_a.name)
    from_request = registry.to_request(LoRASpec(name=None, path=str(tiny_llm_assets.adapter_a), int_id=None))
    assert (startup.lora_int_id, startup.lora_path) == (from_request.lora_int_id, from_request.lora_path)


def test_flag_scanning():
    assert parse_lora_module("a=/x=y") == ("a", "/x=y")
    assert parse_lora_module('{"name": "n", "path": "/p", "base_model_name": "m"}') == ("n", "/p")
    with pytest.raises(ConfigError, match="expected 'name=path'"):
        parse_lora_module("just-a-path")
    check_argv(["m", "--max-lora-rank", "8", "--dry-run"])  # nothing to check: passes
    with pytest.raises(ConfigError, match="--lora-dirs /no/such: no such"):
        check_argv(["m", "--lora_dirs=/no/such", "--dry-run"])  # snake case and '=' as argparse takes them
