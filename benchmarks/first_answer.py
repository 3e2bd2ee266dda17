"""Time to the first answer of ``vllm-omni serve``: worker processes (the default) against inline.

Each *side* is the installed ``vllm-omni`` console script started as a new process; the clock
runs from the start of the command until the first request (polled on ``/health`` every 0.2 s,
then sent once) has been answered with HTTP 200. Sides, run in turn (order rotated per round):

* ``llm/mp``, ``llm/inline``: the tiny Qwen2 (``tools/make_tiny_llm.py``), ``/v1/completions``;
* ``llm/mp-spawn``: ``llm/mp`` with ``VLLM_OMNI_WORKER_START=spawn`` (every worker a fresh
  interpreter: how workers started before the fork server);
* ``demo/mp``, ``demo/inline``: the demo diffusion model (``examples/demo_model``,
  ``tools/train_demo_model.py``), one 2-step image from ``/v1/images/generations``;
* ``demo-x2/mp``, ``demo-x2/inline``: the demo model with ``replicas: 2``.

Reported per side: median seconds to the first answer, the CPU seconds of the whole process
tree at that moment, and the CPU of the worker processes alone. Per model: the ratio
``mp / inline`` (issue 39's goal: at most 1.3), and for the LLM the worker CPU saved per worker
start (``mp-spawn`` minus ``mp``; the fork server's own one import is reported apart).

Run from the repository root::

    .venv/bin/python -m benchmarks.first_answer [--repeats 1] [--json benchmarks/results/first_answer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SIDES = ("llm/mp", "llm/inline", "llm/mp-spawn", "demo/mp", "demo/inline", "demo-x2/mp", "demo-x2/inline")


def _llm_model() -> str:
    sys.path.insert(0, str(REPO))
    from tools.make_tiny_llm import ensure_tiny_llm_assets

    root = Path(os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO / ".cache" / "test_assets")
    return str(ensure_tiny_llm_assets(root).model_dir)


def _command(side: str, port: int) -> tuple[list[str], dict[str, str], str, dict]:
    """argv, extra env, request path and body of ``side``."""
    model, backend = side.split("/")
    env = {"VLLM_OMNI_WORKER_START": "spawn"} if backend == "mp-spawn" else {}
    backend = "mp" if backend == "mp-spawn" else backend
    argv = [str(BIN / "vllm-omni"), "serve"]
    if model == "llm":
        argv += [_llm_model(), "--max-model-len", "256", "--dtype", "float32"]
        path, body = "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    else:
        argv += [str(REPO / "examples" / "demo_model")]
        if model == "demo-x2":
            argv += ["--stage-overrides", '{"0": {"replicas": 2}}']
        path = "/v1/images/generations"
        body = {"model": "m", "prompt": "a red circle", "num_inference_steps": 2, "seed": 0}
    argv += ["--served-model-name", "m", "--port", str(port), "--worker-backend", backend]
    return argv, env, path, body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None, timeout: float = 600) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except OSError:
        return 0


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _roles(root: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The tree of ``root``: the fork server, the workers (its children, or spawned ones), the rest."""
    roles: dict[str, list[psutil.Process]] = {"server": [root], "fork_server": [], "workers": [], "other": []}
    for p in root.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            parent = p.ppid()
        except psutil.NoSuchProcess:
            continue
        if "multiprocessing.forkserver" in cmd and parent == root.pid:
            roles["fork_server"].append(p)
        elif "multiprocessing.forkserver" in cmd or "spawn_main" in cmd:
            roles["workers"].append(p)
        else:
            roles["other"].append(p)
    return roles


def run_side(side: str) -> dict:
    """Start ``side``'s server, time its first answer, stop it."""
    port = _free_port()
    argv, env, path, body = _command(side, port)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO
    )
    try:
        base = f"http://127.0.0.1:{port}"
        while _get(base + "/health", timeout=5) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"{side}: the server exited with {proc.returncode}: {' '.join(argv)}")
            time.sleep(0.2)
        status = _get(base + path, body)
        seconds = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"{side}: the first request got HTTP {status}")
        roles = _roles(psutil.Process(proc.pid))
        cpu = {name: round(_cpu(ps), 2) for name, ps in roles.items()}
        return {"seconds": round(seconds, 2), "cpu_s": cpu, "n_workers": len(roles["workers"])}
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def summarize(samples: dict[str, list[dict]]) -> dict:
    out: dict = {"sides": {}, "ratios": {}}
    for side, runs in samples.items():
        if not runs:
            continue
        out["sides"][side] = {
            "seconds": statistics.median(r["seconds"] for r in runs),
            "tree_cpu_s": statistics.median(sum(r["cpu_s"].values()) for r in runs),
            "worker_cpu_s": statistics.median(r["cpu_s"]["workers"] for r in runs),
            "fork_server_cpu_s": statistics.median(r["cpu_s"]["fork_server"] for r in runs),
            "n_workers": runs[0]["n_workers"],
        }
    sides = out["sides"]
    for model in ("llm", "demo", "demo-x2"):
        if f"{model}/mp" in sides and f"{model}/inline" in sides:
            out["ratios"][f"{model} mp/inline"] = round(
                sides[f"{model}/mp"]["seconds"] / sides[f"{model}/inline"]["seconds"], 3
            )
    if "llm/mp-spawn" in sides and "llm/mp" in sides:
        out["ratios"]["llm mp-spawn/inline"] = round(
            sides["llm/mp-spawn"]["seconds"] / sides["llm/inline"]["seconds"], 3
        )
        out["worker_cpu_saved_per_start_s"] = round(
            sides["llm/mp-spawn"]["worker_cpu_s"] - sides["llm/mp"]["worker_cpu_s"], 2
        )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--sides", default=",".join(SIDES), help="comma-separated subset of " + ", ".join(SIDES)
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    samples: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.repeats):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        for side in order:
            sample = run_side(side)
            samples[side].append(sample)
            print(f"round {r + 1} {side}: {sample}", flush=True)
    result = summarize(samples)
    result.update(
        samples=samples,
        machine={"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        date=time.strftime("%Y-%m-%d %H:%M"),
        command="python -m benchmarks.first_answer " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    print(json.dumps({k: result[k] for k in ("sides", "ratios")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
