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

from tests import preload
from tests.entrypoints.server_utils import HTTP, server_env
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
    weights = str(tiny_llm_assets.model_dir / "model.safetensors")
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
        (["--port", "70000"], "--port 70000: must be between 0 and 65535"),  # bind() would wrap it to 4464
        (["--port", "-1"], "--port -1: must be between 0 and 65535"),  # argparse's value, not the default's
        (["--port=65536", "--dry-run"], "--port 65536: must be between 0 and 65535"),
        # issue 49: a base model's weights as an LLM adapter and as a diffusion --lora-path (the header
        # tells), an out-of-range scale, upstream vllm-omni's flag, a control character in a path
        (["--lora-modules", f"a={weights}", "--enable-lora"], "model.safetensors holds model weights, not a LoRA"),
        (["--lora-path", weights], f"--lora-path {weights}: model.safetensors holds model weights"),
        (["--lora-scale", "500"], "argument --lora-scale: 500 is out of range: give a finite number between -100"),
        (["--lora-scale", "nan"], "argument --lora-scale: nan is out of range"),
        (["--stage-configs-path", "s.yaml"], "upstream vllm-omni's flag; here a stage layout YAML is a deploy "
         "config: pass it with --deploy-config"),
        (["--lora-dirs", "/tmp/a\x1b[31m"], "holds the control character U+001B at position 6"),
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
    assert len(report["results"]) == len(bad_inputs)
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
    from vllm_omni.entrypoints.cli import argv_checks

    with pytest.raises(
        ConfigError, match=r"model '/m\\x07': holds the control character U\+0007 at position 2"
    ):
        argv_checks.check(["/m\x07"], {}, {}, {})  # the model path too


def test_the_checked_address_is_held_for_the_server():
    """``check_bind(hold=True)`` keeps the port bound: nobody else can take it before the server
    listens on that very socket (``take_listener``); other held addresses are released."""
    from vllm_omni.entrypoints.cli import preflight

    preflight.check_bind("127.0.0.1", 0, hold=False)  # closed at once: nothing held
    assert preflight._held == {}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    preflight.check_bind("127.0.0.1", port, hold=True)
    preflight.check_bind("127.0.0.1", port, hold=True)  # checked again (full parser): still held, no error
    try:
        with pytest.raises(
            ConfigError, match=f"--port {port}: cannot listen on 127.0.0.1:{port}: address already"
        ):
            preflight.bind_listener("127.0.0.1", port)  # as another process's bind with SO_REUSEADDR
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        other.close()
        listener = preflight.take_listener("127.0.0.1", port)
        assert listener.getsockname() == ("127.0.0.1", port) and preflight._held == {}
        with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
            conn, _ = listener.accept()  # the held socket is the one that serves
            client.sendall(b"ping")
            assert conn.recv(4) == b"ping"
            conn.close()
        listener.close()
    finally:
        while preflight._held:
            preflight._held.popitem()[1].close()


def test_server_holds_its_port_while_the_stages_load(tiny_llm_assets, tmp_path):
    """``serve`` binds ``--port`` before vLLM is imported and keeps it while its stages load (CI
    once lost the port to another process in the 42 s between the check and uvicorn's bind)."""
    from tests.entrypoints.server_utils import free_port, serve_command
    from tests.waiting import wait_until

    port = free_port()
    log = tmp_path / "server.log"
    cmd = serve_command(tiny_llm_assets.model_dir, port, "--max-model-len", "128")
    with open(log, "w") as out:
        proc = preload.popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env())
    try:

        def loading() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            return "starting Stage 0" in log.read_text(errors="replace")

        wait_until(loading, "the server to start loading stage 0", cap_s=900, interval_s=0.2,
                   describe=lambda: log.read_text()[-3000:])  # fmt: skip
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError) as refused:
                other.bind(("127.0.0.1", port))
        assert refused.value.errno == 98, refused.value  # EADDRINUSE
        # a client that asks while the stages load is answered once the server is up
        health = HTTP.get(f"http://127.0.0.1:{port}/health", timeout=900)
        assert health.status_code == 200
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=600)


def test_dry_run_in_either_spelling_binds_nothing():
    """``--dry-run`` and ``--dry_run`` (argparse takes both) never bind: a busy port is no error."""
    from vllm_omni.entrypoints.cli import preflight

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for flag in ("--dry-run", "--dry_run", "--dry-run=true"):
            preflight.check_argv(["m", "--host", "127.0.0.1", "--port", port, flag], hold=True)
        assert preflight._held == {}
        with pytest.raises(ConfigError, match="already in use"):
            preflight.check_argv(["m", "--host", "127.0.0.1", "--port", port])


def test_a_start_up_adapter_with_unreadable_files_is_refused_before_loading(tmp_path):
    """``--lora-modules`` / ``--lora-path`` files are read as far as the start-up can without the
    stage: the config JSON (peft's rules) and the safetensors header; a broken one is a one-line
    refusal before any engine starts (it failed after 43 s of loading, with three tracebacks)."""
    from vllm_omni.entrypoints.cli.serve import parse_serve_argv

    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "adapter_config.json").write_text("{not json")
    (bad_json / "adapter_model.safetensors").write_bytes(b"")
    bad_header = tmp_path / "bad_header"
    bad_header.mkdir()
    (bad_header / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    (bad_header / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    for folder, why in ((bad_json, "adapter_config.json"), (bad_header, "not a readable safetensors file")):
        for flags in (["--lora-modules", f"x={folder}"], ["--lora-path", str(folder)]):
            with pytest.raises(ConfigError, match=why) as info:
                parse_serve_argv(["some-model", *flags])
            assert str(folder) in str(info.value)


def test_warm_cache_answers_help_groups_and_override_keys_without_vllm(
    tmp_path, tiny_llm_assets, monkeypatch
):
    """Issue 49: with the command-line cache written, ``--help=<group>`` / ``--help=<word>`` and a
    misspelled ``--stage-overrides`` key are answered without importing vLLM (exit 0 / 2)."""
    from vllm_omni.entrypoints.cli import fast

    root = tmp_path / "cache"
    env = server_env(VLLM_OMNI_CACHE_ROOT=str(root))
    monkeypatch.setenv("VLLM_OMNI_CACHE_ROOT", str(root))
    path = fast._cache_file()
    lora_help = "LoRAConfig:\n  Configuration for LoRA.\n\n  --max-lora-rank {1,8,16}\n                        Max rank.\n"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({
        "options": {"--stage-overrides": 1, "--max-lora-rank": 1},
        "group_help": {"LoRAConfig": lora_help, "ModelConfig": "ModelConfig:\n  --dtype DTYPE\n"},
        "defaults": {"max_lora_rank": 16, "stage_keys": ["enable_lora", "max_lora_rank"]},
    }))  # fmt: skip
    model = str(tiny_llm_assets.model_dir)
    argvs = [
        ["serve", model, "--help=loraconfig"],
        ["serve", model, "--help=max-lora"],
        ["serve", model, "--stage-overrides", '{"0": {"enable_lroa": true}}'],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["code"] for r in report["results"]] == [0, 0, 2]
    assert proc.stdout.count(
        lora_help
    ) == 1 and "  --max-lora-rank {1,8,16}\n                        Max rank." in (
        proc.stdout.replace(lora_help, "", 1)
    )
    assert (
        "--stage-overrides, stage 0: unknown option 'enable_lroa' (did you mean 'enable_lora'?)"
        in proc.stderr
    )
    assert (report["vllm"], report["torch"]) == (False, False)
