"""Reliability run against live servers: load, fuzz, faults and shutdown, LLM and diffusion.

Starts real ``vllm-omni serve`` processes on loopback ports (the tiny test LLM with two adapters, and the
shipped demo diffusion model with its two adapters) and reports, per server:

* ``responses_5xx``: responses with a status >= 500, over every phase;
* ``mismatches``: concurrent answers that differ from the sequential reference of the same request
  (greedy text for the LLM; decoded pixels for images, beyond ``PIXEL_TOLERANCE`` levels: a batch
  rounds differently from a single run; ``max_pixel_diff`` is the largest difference seen);
* ``hangs``: requests without an answer within ``--timeout`` seconds;
* ``health_after_fuzz``: ``GET /health`` after the fuzz and fault phases (200 = still serving);
* ``left_processes``: processes started by the server that are alive 10 s after it exited on SIGTERM,
  sent while requests were in flight; ``shutdown_s``: how long the server took to exit.

and, from :mod:`benchmarks.mixed_batch`, the alternating / uniform ratio of mixed adapter batches.
Every request loop is bounded in count and time, and all traffic goes to 127.0.0.1.

Run from the repository root::

    .venv/bin/python -m benchmarks.reliability [--requests 24] [--fuzz 150] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "entrypoints")]

from server_utils import free_port, serve_command, server_env, start_server  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello, my name is"]
#: Largest per-pixel difference (of 255) between a batched image and the same request run alone.
PIXEL_TOLERANCE = 3
SHAPES = ["a red circle", "a blue square", "a green triangle", "a yellow circle"]

#: Values that have broken request parsers somewhere: wrong types, extremes, bad text.
NASTY: list[Any] = [
    None,
    True,
    -1,
    0,
    2**31,
    10**400,
    -(10**40),
    1e308,
    float("1e-320"),
    "",
    " ",
    "\ud800",
    "\x00",
    "a" * 5000,
    "NaN",
    "Infinity",
    "1e999",
    [],
    [None],
    {},
    {"a": {"b": [1]}},
    [[1, 2], [3]],
    [-5],
    ["\ud800"],
    "../../etc/passwd",
    "/dev/zero",
    3.5,
    "512x512",
    "99999x99999",
    "0x0",
]


# ---------------------------------------------------------------- helpers
def post(client: httpx.Client, path: str, body: Any, stats: dict, **kw: Any) -> httpx.Response | None:
    """POST ``body`` as JSON (or raw ``content``); counts 5xx and hangs in ``stats``."""
    try:
        if "content" in kw:
            r = client.post(path, **kw)
        else:
            r = client.post(
                path,
                content=json.dumps(body, allow_nan=True),
                headers=kw.get("headers") or {"content-type": "application/json"},
            )
    except httpx.TimeoutException:
        stats["hangs"] += 1
        return None
    except httpx.HTTPError as exc:
        stats.setdefault("transport_errors", []).append(f"{path}: {exc!r}"[:200])
        return None
    if r.status_code >= 500:
        stats["responses_5xx"] += 1
        stats.setdefault("examples_5xx", []).append(f"{path} {r.status_code}: {r.text[:160]}")
    return r


def mutate(body: dict, rng: random.Random) -> dict:
    """``body`` with one to three fields replaced, dropped or added."""
    out = dict(body)
    for _ in range(rng.randint(1, 3)):
        action = rng.random()
        key = rng.choice([*out.keys(), "lora", "extra_field", "n", "stream"]) if out else "prompt"
        if action < 0.7:
            out[key] = rng.choice(NASTY)
        elif action < 0.85:
            out.pop(key, None)
        else:
            out["lora"] = rng.choice(
                [
                    {"name": rng.choice(NASTY), "path": rng.choice(NASTY)},
                    [{"name": "a", "scale": rng.choice(NASTY)}],
                ]
            )
    return out


def run_concurrently(fn: Callable[[Any], Any], items: list[Any], workers: int = 8) -> list[Any]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def descendants(pid: int) -> set[int]:
    """Pids of every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def shutdown_phase(srv, client: httpx.Client, slow_body: tuple[str, dict], stats: dict) -> None:
    """SIGTERM with requests in flight: time to exit, and processes left 10 s later."""
    procs = descendants(srv.proc.pid)
    path, body = slow_body
    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(post, client, path, body, {"responses_5xx": 0, "hangs": 0})
        time.sleep(1.0)
        procs |= descendants(srv.proc.pid)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        try:
            srv.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait()
        stats["shutdown_s"] = round(time.monotonic() - start, 2)
    time.sleep(10)
    left = sorted(p for p in procs if alive(p))
    stats["left_processes"] = len(left)
    for p in left:  # clean up what the product left behind
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


# ---------------------------------------------------------------- LLM server
def llm_phase(args, work: Path) -> dict:
    from tools.make_tiny_llm import ensure_tiny_llm_assets

    assets = ensure_tiny_llm_assets(
        Path(os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO / ".cache" / "test_assets")
    )
    port = free_port()
    cmd = serve_command(
        assets.model_dir, port, "--served-model-name", "tiny", "--enable-lora", "--max-lora-rank", "16",
        "--max-loras", "2", "--max-model-len", "256", "--max-num-seqs", "8",
        "--lora-modules", f"a={assets.adapter_a}", f"b={assets.adapter_b}", "--lora-dirs", str(work),
    )  # fmt: skip
    # the engine in its own process, as `vllm serve` runs it by default (the shutdown phase counts it)
    env = server_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    srv = start_server(cmd, port, work / "llm_server.log", env)
    stats: dict[str, Any] = {"responses_5xx": 0, "hangs": 0, "mismatches": 0}
    client = httpx.Client(base_url=srv.base_url, timeout=args.timeout)
    try:
        requests = [(p, m) for p in PROMPTS for m in ("tiny", "a", "b")]

        def ask(item):
            r = post(client, "/v1/completions", {"model": item[1], "prompt": item[0], "max_tokens": 12,
                                                  "temperature": 0}, stats)  # fmt: skip
            return None if r is None or r.status_code != 200 else r.json()["choices"][0]["text"]

        reference = {item: ask(item) for item in requests}  # one at a time
        load = [requests[i % len(requests)] for i in range(max(args.requests, len(requests)))]
        random.Random(0).shuffle(load)
        for item, text in zip(load, run_concurrently(ask, load), strict=True):
            stats["mismatches"] += text != reference[item]
        stats["load_requests"] = len(load)
        fuzz_routes(client, args, stats, {
            "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 4},
            "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 4},
            "/v1/load_lora_adapter": {"lora_name": "c", "lora_path": str(assets.adapter_a)},
            "/v1/unload_lora_adapter": {"lora_name": "c"},
        })  # fmt: skip
        stats["after_fuzz_mismatches"] = sum(ask(item) != reference[item] for item in requests[:6])
        stats["health_after_fuzz"] = client.get("/health").status_code
        shutdown_phase(srv, client, ("/v1/completions", {"prompt": "x", "max_tokens": 200}), stats)
    finally:
        srv.stop()
    return stats


def fuzz_routes(client: httpx.Client, args, stats: dict, valid: dict[str, dict]) -> None:
    """``--fuzz`` mutated bodies spread over ``valid``'s routes, plus wrong content types."""
    rng = random.Random(1)
    routes = list(valid)
    for i in range(args.fuzz):
        path = routes[i % len(routes)]
        post(client, path, mutate(valid[path], rng), stats)
    for path in routes:
        post(client, path, None, stats, content=b"\xff\xfe{not json", headers={"content-type": "text/plain"})
        post(
            client,
            path,
            None,
            stats,
            content=b'{"prompt": "\\ud800"}',
            headers={"content-type": "application/json"},
        )
    stats["fuzz_requests"] = args.fuzz + 2 * len(routes)


# ---------------------------------------------------------------- diffusion server
def diffusion_phase(args, work: Path) -> dict:
    import numpy as np
    from PIL import Image

    model = REPO / "examples" / "demo_model"
    port = free_port()
    cmd = serve_command(
        model, port, "--served-model-name", "demo", "--max-loras", "2", "--lora-dirs", str(model / "adapters")
    )
    srv = start_server(
        cmd, port, work / "diffusion_server.log", server_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    )
    stats: dict[str, Any] = {"responses_5xx": 0, "hangs": 0, "mismatches": 0}
    client = httpx.Client(base_url=srv.base_url, timeout=args.timeout)
    adapters = {
        "none": None,
        "warm": [{"name": "warm", "path": str(model / "adapters" / "warm")}],
        "both": [{"name": "warm", "path": str(model / "adapters" / "warm"), "scale": 0.5},
                 {"name": "stripes", "path": str(model / "adapters" / "stripes")}],
    }  # fmt: skip
    try:
        requests = [(p, a) for p in SHAPES[:2] for a in adapters]

        def draw(item):
            body = {"prompt": item[0], "size": "64x64", "num_inference_steps": 4, "seed": 7}
            if adapters[item[1]]:
                body["lora"] = adapters[item[1]]
            r = post(client, "/v1/images/generations", body, stats)
            if r is None or r.status_code != 200:
                return None
            png = base64.b64decode(r.json()["data"][0]["b64_json"])
            return np.asarray(Image.open(io.BytesIO(png))).astype(np.int16)

        def differs(pixels, ref) -> bool:
            # batched and single runs differ in float rounding (GEMM shapes), not in content: allow
            # PIXEL_TOLERANCE levels of 255, and record the largest difference seen
            if pixels is None or ref is None:
                return pixels is not ref
            diff = int(np.abs(pixels - ref).max())
            stats["max_pixel_diff"] = max(stats.get("max_pixel_diff", 0), diff)
            return diff > PIXEL_TOLERANCE

        reference = {item: draw(item) for item in requests}
        load = [requests[i % len(requests)] for i in range(max(args.requests, len(requests)))]
        random.Random(0).shuffle(load)
        for item, pixels in zip(load, run_concurrently(draw, load), strict=True):
            stats["mismatches"] += differs(pixels, reference[item])
        stats["load_requests"] = len(load)
        fuzz_routes(client, args, stats, {
            "/v1/images/generations": {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 2},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "a red circle"}], "size": "64x64",
                                     "num_inference_steps": 2},
        })  # fmt: skip
        stats["after_fuzz_mismatches"] = sum(differs(draw(item), reference[item]) for item in requests[:3])
        stats["health_after_fuzz"] = client.get("/health").status_code
        slow = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 60}
        shutdown_phase(srv, client, ("/v1/images/generations", slow), stats)
    finally:
        srv.stop()
    return stats


def mixed_batch_ratio(work: Path) -> float | None:
    out = work / "mixed_batch.json"
    cmd = [sys.executable, "-m", "benchmarks.mixed_batch", "--repeats", "3", "--json", str(out)]
    if subprocess.run(cmd, cwd=REPO, env=server_env(), capture_output=True).returncode != 0:
        return None
    return round(json.loads(out.read_text())["ratio_alternating_uniform"], 3)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24, help="concurrent requests in the load phase")
    ap.add_argument("--fuzz", type=int, default=150, help="mutated bodies per server")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    ap.add_argument("--skip", nargs="*", default=[], choices=["llm", "diffusion", "mixed_batch"])
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"requests": args.requests, "fuzz": args.fuzz}
    with tempfile.TemporaryDirectory(prefix="omni_reliability_") as tmp:
        work = Path(tmp)
        if "llm" not in args.skip:
            results["llm"] = llm_phase(args, work)
        if "diffusion" not in args.skip:
            results["diffusion"] = diffusion_phase(args, work)
        if "mixed_batch" not in args.skip:
            results["mixed_batch_alternating_over_uniform"] = mixed_batch_ratio(work)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
