"""Helpers for the serving tests: a real server process on a free loopback port."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests import preload
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback port free now, outside the kernel's ephemeral range when it can be.

    A port the kernel handed out for ``bind(0)`` is handed out again to the next process that
    asks (torch's rendezvous, a client): CI once saw a server refused a port picked that way.
    Ports below the ephemeral range are only taken by processes that name them.
    """
    low, _ = _ephemeral_ports()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(10000, low) if low > 10100 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free loopback port found")


def with_port(cmd: list[str], port: int) -> list[str]:
    """``cmd`` with the value of its ``--port`` flag replaced by ``port``."""
    out = list(cmd)
    i = out.index("--port")
    out[i + 1] = str(port)
    return out


def port_taken(log_text: str) -> bool:
    """The server's log says it could not bind its port (another process holds it)."""
    return "cannot listen on" in log_text and "address already in use" in log_text


def console_script(name: str) -> list[str]:
    """The installed console script ``name`` (``vllm``, ``vllm-omni``) next to this Python."""
    path = BIN / name
    if path.exists():
        return [str(path)]
    module = {"vllm": "vllm.entrypoints.cli.main", "vllm-omni": "vllm_omni.entrypoints.cli.main"}[name]
    return [sys.executable, "-m", module]


def serve_command(model, port: int, *flags: str, cli: str = "vllm-omni") -> list[str]:
    """``<cli> serve <model>`` on 127.0.0.1:``port`` with ``flags`` (``cli="vllm"`` adds ``--omni``)."""
    omni = ["--omni"] if cli == "vllm" else []
    return console_script(cli) + [
        "serve", str(model), *omni, "--host", "127.0.0.1", "--port", str(port), *flags, "--disable-uvicorn-access-log"
    ]  # fmt: skip


def decode_png(b64: str):
    """A base64 PNG as an ``int16`` ``(H, W, 3)`` RGB array (differences of two never wrap)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def server_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@dataclass
class LiveServer:
    """A server subprocess; ``url("/v1/models")`` etc."""

    base_url: str
    proc: subprocess.Popen
    log_path: Path

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=300)  # a graceful stop takes minutes at a load of 30
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=600)


#: One client for the suite's HTTP calls (``HTTP.post(...)`` as ``httpx.post(...)``, same default
#: 5 s timeout): ``httpx.post`` builds a client, and with it an SSL context, per call (~20 ms of
#: CPU; ~1,500 calls in the suite). No kept-alive connections, so a call never reuses a socket of
#: a server that has gone (a later server may take its port). Thread-safe.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def start_server(
    cmd: list[str], port: int, log_path: Path, env: dict[str, str], timeout: float = 1200,
    own_workers: bool = False,
) -> LiveServer:  # fmt: skip
    """Run ``cmd`` (which must bind 127.0.0.1:``port``) and wait for ``GET /health`` = 200.

    ``own_workers``: the server's stage workers are its descendants (``tests/preload.py``), for
    tests of its process tree.

    ``timeout`` caps the wait (seconds): a start-up takes ~20 s on a quiet 2-core machine and
    several minutes at a load of 30, so the cap is generous; a server that exits fails at once.
    A server refused its port (taken by another process between :func:`free_port` and the
    server's bind, within a second of the start) is started again on another port, twice at
    most; use ``server.url`` / ``server.base_url``, not ``port``, afterwards.
    """
    for attempt in range(3):
        try:
            return _start_server(cmd, port, log_path, env, timeout, own_workers)
        except PortTaken:
            if attempt == 2:
                raise
            port = free_port()
            cmd = with_port(cmd, port)
    raise AssertionError("unreachable")


class PortTaken(RuntimeError):
    """The server exited because its port was in use."""


def _start_server(
    cmd: list[str], port: int, log_path: Path, env: dict[str, str], timeout: float, own_workers: bool
) -> LiveServer:
    log = open(log_path, "w")  # noqa: SIM115 - owned by the process
    proc = preload.popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, own_workers=own_workers
    )
    server = LiveServer(f"http://127.0.0.1:{port}", proc, log_path)

    poller = httpx.Client(timeout=10)  # one client: a new one per poll costs ~20 ms CPU (its SSL context)

    def healthy() -> bool:
        if proc.poll() is not None:
            kind = PortTaken if port_taken(server.log_tail()) else RuntimeError
            raise kind(f"server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            return poller.get(server.url("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, "the server to answer /health with 200", cap_s=timeout, interval_s=0.5,
                   describe=server.log_tail)  # fmt: skip
    except BaseException:
        server.stop()
        raise
    finally:
        poller.close()
    return server


def assert_openai_error(response: httpx.Response, statuses=(400, 422)) -> dict:
    """The response is an OpenAI-style error with one of ``statuses``; returns the error object."""
    assert response.status_code in statuses, (response.status_code, response.text[:500])
    err = response.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == response.status_code and isinstance(err["type"], str)
    return err


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".complete", ".lock"))
    return dst


def input_audio_part(samples, rate: int = 16000, fmt: str = "wav") -> dict:
    """An OpenAI ``input_audio`` chat content part: ``samples`` (floats in [-1, 1]) as a 16-bit PCM
    mono WAV at ``rate``, base64."""
    import base64
    import io
    import wave

    import numpy as np

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.round(np.asarray(samples) * 32767).astype("<i2").tobytes())
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": fmt},
    }
