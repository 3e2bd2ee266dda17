"""The first minute with ``vllm-omni`` (issue 39): ``--version``, ``serve --help`` with our flags
first, and every start-up mistake the flags and files show refused by the real command before
vLLM or torch is imported, with one ``error:`` line naming the flag or file and the fix.

Each command runs as a fresh ``vllm-omni`` process (not forked from the suite's preloaded
interpreter, which has vLLM imported) with an import guard (``sitecustomize``) that ends the
process with status 99 the moment ``vllm`` or ``torch`` is imported: exit status 2 and the
message prove the refusal came first. How long a refusal takes is a benchmark
(``benchmarks/startup_checks.py``); the bound here only guards against a hang.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.entrypoints.server_utils import server_env
from vllm_omni.entrypoints.cli import fast, flags

VLLM_OMNI = Path(sys.executable).parent / "vllm-omni"
GUARD = """\
import os, sys


class _RefuseHeavyImports:
    def find_spec(self, name, path=None, target=None):
        asked_by = sys._getframe(2).f_globals.get("__name__")  # importlib.util.find_spec only looks
        if name.partition(".")[0] in ("vllm", "torch") and asked_by != "importlib.util":
            sys.stdout.flush()
            sys.stderr.write(f"import guard: {name} imported\\n")
            sys.stderr.flush()
            os._exit(99)
        return None


sys.meta_path.insert(0, _RefuseHeavyImports())
"""


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Run ``vllm-omni <argv>`` guarded; ``cache="warm"`` uses a cache filled by this (test) process."""
    root = tmp_path_factory.mktemp("first_minute")
    (root / "guard").mkdir()
    (root / "guard" / "sitecustomize.py").write_text(GUARD)
    warm = root / "warm_cache"

    def run(argv: list[str], cache: str = "cold") -> tuple[int, str, str]:
        folder = warm if cache == "warm" else root / f"cold_{time.monotonic_ns()}"
        if cache == "warm" and not warm.exists():
            _fill_cache(warm)
        env = server_env(PYTHONPATH=str(root / "guard"), VLLM_OMNI_CACHE_ROOT=str(folder), COLUMNS="100")
        started = time.monotonic()
        proc = subprocess.run([str(VLLM_OMNI), *argv], env=env, capture_output=True, text=True, timeout=600)
        assert time.monotonic() - started < 120, "a hang, not a speed bound (see the module docstring)"
        return proc.returncode, proc.stdout, proc.stderr

    return run


def _fill_cache(folder: Path) -> None:
    """The cache a first full run writes, written here (vLLM is imported in the test process already)."""
    import os

    from vllm_omni.entrypoints.cli.main import make_parser

    old = os.environ.get("VLLM_OMNI_CACHE_ROOT")
    os.environ["VLLM_OMNI_CACHE_ROOT"] = str(folder)
    try:
        parser = make_parser()
        fast.save(parser, parser.serve_parser)
    finally:
        os.environ.pop("VLLM_OMNI_CACHE_ROOT") if old is None else os.environ.update(VLLM_OMNI_CACHE_ROOT=old)
    assert list(folder.glob("cli-*.json"))


def test_version_and_help_print_our_flags_before_vllm_is_imported(cli):
    code, out, err = cli(["--version"])
    assert (code, err) == (0, "") and out.startswith("vllm-omni 0.1.0 (vLLM ") and out.count("\n") == 1
    # cold cache: our flags are printed, then the import guard stops the vLLM part
    code, out, err = cli(["serve", "--help"])
    assert code == 99 and "import guard: vllm" in err, err
    ours = out.index("vllm-omni:")
    assert ours < out.index("--lora-modules") and ours < out.index("--worker-backend {inline,mp,ray}")
    # warm cache: the same, then vLLM's flag groups, with nothing imported
    code, warm_out, err = cli(["serve", "--help"], cache="warm")
    assert (code, err) == (0, "") and warm_out.startswith(out)
    assert "vLLM engine flags" in warm_out and "LoRAConfig" in warm_out.split("vLLM engine flags")[1]
    code, out, err = cli(["--help"])
    assert (code, err) == (0, "") and "--version" in out and "serve" in out


def _cases(tmp: Path, assets) -> list[tuple[list[str], str, str]]:
    """(argv after ``serve``, the cache, the message's distinctive part), one mistake each."""
    model, rank64 = str(assets.model_dir), str(assets.adapter_rank64)
    (tmp / "empty").mkdir(exist_ok=True)
    bad_config, truncated = tmp / "bad_config", tmp / "truncated"
    for folder in (bad_config, truncated):
        shutil.copytree(assets.adapter_a, folder, dirs_exist_ok=True)
    (bad_config / "adapter_config.json").write_text('{"r": 8,')
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return [
        (["/no/such/model"], "cold", "model /no/such/model: no such directory"),
        ([str(tmp / "empty")], "cold", "holds neither config.json (transformers model) nor model_index.json"),
        ([model, "--stage-overrides", "{bad"], "cold", "--stage-overrides is not valid JSON"),
        ([model, "--worker-backend", "mpp"], "cold", "argument --worker-backend: invalid choice 'mpp': choose from"),
        ([model, "--port", "80a"], "cold", "argument --port: invalid int value '80a': give an integer"),
        ([model, "--lora-modules", f"a={assets.adapter_a}"], "cold", "LoRA is off on this LLM model; add --enable-lora"),
        ([model, "--enable-lora", "--lora-modules", f"r={rank64}"], "cold",
         "adapter_config.json has rank 64, above --max-lora-rank (default 16); pass --max-lora-rank 64"),
        ([model, "--enable-lora", "--max-lora-rank", "32", "--lora-modules", f"r={rank64}"], "warm",
         "rank 64, above --max-lora-rank 32"),
        ([model, "--enable-lora", "--lora-modules", f"m={model}"], "cold", "is a model folder, not a LoRA adapter"),
        ([model, "--enable-lora", "--lora-modules", f"c={bad_config}"], "cold", "adapter_config.json cannot be read as JSON"),
        ([model, "--enable-lora", "--lora-modules", f"t={truncated}"], "cold",
         "adapter_model.safetensors is not a safetensors file (its header length"),
        ([model, "--max-lora-rank", "abc"], "warm", "argument --max-lora-rank: invalid int value 'abc'"),
        ([model, "--max-lora-rank", "7"], "warm", "argument --max-lora-rank: invalid choice '7': choose from 1, 8"),
        ([model, "--dtype", "fp8x"], "warm", "argument --dtype: invalid choice 'fp8x'"),
    ]  # fmt: skip


def test_start_up_mistakes_are_refused_before_vllm_is_imported(cli, tmp_path, tiny_llm_assets):
    for argv, cache, message in _cases(tmp_path, tiny_llm_assets):
        code, out, err = cli(["serve", *argv], cache=cache)
        assert code == 2 and out == "", (argv, code, err)
        assert err.startswith("vllm-omni serve: error: ") and err.count("\n") == 1, (argv, err)
        assert message in err, (argv, err)
        assert "/model.safetensors" not in err, "never suggest the base model's weights as an adapter"


def test_resolved_stages_refuse_start_up_adapters_they_cannot_load(tiny_llm_assets, monkeypatch, capsys):
    """What only the resolved config tells (here: options given per stage) is refused by the full
    parser, still before any engine starts."""
    from tests.entrypoints.test_cli import run_main

    model, rank64 = str(tiny_llm_assets.model_dir), str(tiny_llm_assets.adapter_rank64)
    code, err = run_main(
        [
            model,
            "--stage-overrides",
            '{"0": {"enable_lora": true}}',
            "--lora-modules",
            f"r={rank64}",
            "--dry-run",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 2 and "r=" in err and "rank 64, above the stages' max_lora_rank 16" in err, err
    code, err = run_main(
        [
            model,
            "--stage-overrides",
            '{"0": {"max_model_len": 64}}',
            "--lora-modules",
            f"a={rank64}",
            "--dry-run",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 2 and "no stage has LoRA enabled; add --enable-lora" in err, err


def test_our_flag_choices_are_the_configs():
    from vllm_omni.config.diffusion import LORA_BACKENDS
    from vllm_omni.config.omni_config import WORKER_BACKENDS

    assert (flags.WORKER_BACKEND_CHOICES, flags.LORA_BACKEND_CHOICES) == (WORKER_BACKENDS, LORA_BACKENDS)


def test_start_up_adapters_count_toward_the_host_cache(tiny_llm_assets):
    """Without --max-cpu-loras the LLM stage's host cache holds every --lora-modules adapter (at least
    --max-loras); a value given is kept."""
    from vllm_omni.entrypoints.cli.serve import parse_serve_argv

    model, a, b = str(tiny_llm_assets.model_dir), tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_b
    modules = ["--lora-modules", f"a={a}", f"b={b}"]
    assert parse_serve_argv([model, "--enable-lora", *modules])[0].options["max_cpu_loras"] == 2
    assert (
        parse_serve_argv([model, "--enable-lora", "--max-loras", "3", *modules])[0].options["max_cpu_loras"]
        == 3
    )
    given = parse_serve_argv([model, "--enable-lora", "--max-cpu-loras", "5", *modules])[0]
    assert given.options["max_cpu_loras"] == 5
    assert "max_cpu_loras" not in parse_serve_argv([model, "--enable-lora"])[0].options
