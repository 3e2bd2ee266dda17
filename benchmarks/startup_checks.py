"""How fast ``vllm-omni serve`` refuses a start-up mistake (issues 23 and 39: under 3 s).

Each case runs the installed ``vllm-omni`` console script as a new process with one bad input
(a missing ``--lora-modules`` folder, a missing ``--lora-path``, a port in use, a deploy YAML
that is not YAML, a missing model folder, bad ``--stage-overrides`` JSON, a bad choice,
``--lora-modules`` without ``--enable-lora``, an adapter rank above ``--max-lora-rank``), and
``--version`` / ``serve --help`` (exit 0), and measures the wall time to its exit, interleaved
``--repeats`` times with
``python -c "import vllm"`` (the least any check after vLLM's import could cost, before any
engine starts). Reported per case: median seconds, and the ratio to the vLLM import.

    .venv/bin/python -m benchmarks.startup_checks [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def _run(argv: list[str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    return time.perf_counter() - t0, proc.returncode, proc.stderr.strip().splitlines()[-1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cli = (
        [str(BIN / "vllm-omni")]
        if (BIN / "vllm-omni").exists()
        else [sys.executable, "-m", "vllm_omni.entrypoints.cli.main"]
    )
    tmp = Path(tempfile.mkdtemp(prefix="startup_checks_"))
    (tmp / "bad.yaml").write_text("stages: [\n")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = str(held.getsockname()[1])
    model = str(tmp)  # never loaded: every case is refused first
    (tmp / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    adapter = tmp / "rank64"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 64, "lora_alpha": 64}')
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    (adapter / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    cases = {
        "lora_modules_missing": ["--lora-modules", f"a={tmp / 'missing'}"],
        "lora_path_missing": ["--lora-path", "missing.safetensors"],
        "port_in_use": ["--host", "127.0.0.1", "--port", port],
        "deploy_yaml_invalid": ["--deploy-config", str(tmp / "bad.yaml")],
        "model_missing": ["--model", str(tmp / "no_model")],
        "stage_overrides_json": ["--stage-overrides", "{bad"],
        "bad_choice": ["--worker-backend", "mpp"],
        "lora_without_enable_lora": ["--lora-modules", f"a={adapter}"],
        "rank_above_max_lora_rank": ["--enable-lora", "--lora-modules", f"a={adapter}"],
    }
    answered = {"version": ["--version"], "serve_help": ["serve", "--help"]}
    times: dict[str, list[float]] = {name: [] for name in [*cases, "import_vllm"]}
    messages: dict[str, str] = {}
    for _ in range(args.repeats):
        for name, flags in cases.items():
            seconds, code, last = _run([*cli, "serve", model, *flags])
            assert code == 2, (name, code, last)
            times[name].append(seconds)
            messages[name] = last[0] if last else ""
        for name, argv in answered.items():
            seconds, code, _ = _run([*cli, *argv])
            assert code == 0, (name, code)
            times.setdefault(name, []).append(seconds)
        times["import_vllm"].append(_run([sys.executable, "-c", "import vllm"])[0])
    held.close()
    base = statistics.median(times["import_vllm"])
    report = {
        "repeats": args.repeats,
        "import_vllm_s": round(base, 3),
        "cases": {
            name: {
                "median_s": round(statistics.median(times[name]), 3),
                "ratio_to_import_vllm": round(statistics.median(times[name]) / base, 3),
                "message": messages[name],
            }
            for name in cases
        },
        "answered": {name: {"median_s": round(statistics.median(times[name]), 3)} for name in answered},
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
