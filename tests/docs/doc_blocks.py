"""Run the fenced code blocks of ``docs/**/*.md`` on the tiny test models.

Conventions (also described in ``docs/contributing_docs.md``):

* **Placeholders.** Every ``/path/to/<name>`` in a block is rewritten to ``<assets>/<name>``, a
  directory the test builds from the tiny test assets (see :data:`PLACEHOLDERS`). A name that
  is not listed there fails the test, so the docs cannot use a path nobody checks.
  ``localhost:8000`` is rewritten to the address of the page's live server (``serve`` below).
* **Languages.** ``python``: executed in order, one namespace per page, ``__name__ ==
  "__main__"``, working directory = a fresh per-page folder. ``bash`` / ``sh`` / ``shell``:
  every command must be one this module can check (:func:`run_bash_block`). ``yaml`` /
  ``json``: parsed. ``text``: literal output or synopsis, never run. Anything else fails.
* **Markers.** An HTML comment on the line(s) right before a fence:
  ``<!-- docs-test: skip <reason> -->`` (not run; a reason is required),
  ``<!-- docs-test: file <name> -->`` (write the block to ``<name>`` in the page folder),
  ``<!-- docs-test: serve -->`` (a bash block with one serve command: also start that server
  in-process for the rest of the page), ``<!-- docs-test: expect-error -->`` (the block's
  curl replies must be OpenAI error objects; by default they must not be).
"""

from __future__ import annotations

import contextlib
import io
import json
import linecache
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS_DIR = REPO_ROOT / "docs"

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<body>.*?)\s*-->")
_PLACEHOLDER = re.compile(r"/path/to/([A-Za-z0-9_.\-/]+)")
RUN_LANGS = {"python", "bash", "sh", "shell", "yaml", "yml", "json"}
NEVER_RUN_LANGS = {"text", "mermaid"}
KNOWN_MARKERS = {"skip", "file", "serve", "expect-error"}

#: placeholder name -> (asset key, copy?). Adapters are copied so that a ``--lora-dirs``
#: allow-list on their parent folder holds them after ``realpath``; models are symlinked.
PLACEHOLDERS: dict[str, tuple[str | None, bool]] = {
    "model": ("llm_model", False),  # tiny Qwen2 (HF format)
    "llm_loras/adapter_a": ("llm_adapter_a", True),  # PEFT, r 8, q/v
    "llm_loras/adapter_b": ("llm_adapter_b", True),  # PEFT, r 16, all linear
    "z_image": ("z_image", False),  # tiny Z-Image diffusers directory
    "z_image_loras/style": ("z_attn", True),  # PEFT, r 4, attention
    "z_image_loras/detail": ("z_ff", True),  # PEFT, r 8, feed-forward
    "z_image_loras/style.safetensors": ("z_attn_file", True),  # diffusers single file (distill)
    "qwen2_5_omni": ("omni_model", False),  # tiny Qwen2.5-Omni checkpoint
    "qwen2_5_omni_loras/thinker": ("omni_thinker_adapter", True),  # PEFT, whole-model keys
    "does_not_exist": (None, False),  # never created: for examples of errors
}
# folders that exist because their entries do (usable as --lora-dirs roots)
PLACEHOLDER_DIRS = {"llm_loras", "z_image_loras", "qwen2_5_omni_loras"}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def extract_blocks(path: Path) -> list[Block]:
    """Fenced blocks of one page with the ``docs-test`` markers right above them."""
    page = str(path.relative_to(DOCS_DIR))
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m["fence"], m["lang"].lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(m["indent"]) :] if lines[i].startswith(m["indent"]) else lines[i])
            i += 1
        i += 1
        markers: dict[str, str] = {}
        j = start - 1
        while j >= 0 and _MARKER.search(lines[j]) and lines[j].strip().startswith("<!--"):
            key, _, value = _MARKER.search(lines[j])["body"].partition(" ")
            if key not in KNOWN_MARKERS:
                raise ValueError(f"{page}:{j + 1}: unknown docs-test marker {key!r}; known: {KNOWN_MARKERS}")
            markers[key] = value.strip()
            j -= 1
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n", markers))
    return blocks


def doc_pages() -> list[Path]:
    return sorted(DOCS_DIR.rglob("*.md"))


# ------------------------------------------------------------------ assets
def build_assets(root: Path, assets: dict[str, Path]) -> Path:
    """Lay out ``root/<placeholder>`` for every entry of :data:`PLACEHOLDERS`."""
    for name, (key, copy) in PLACEHOLDERS.items():
        dst = root / name
        if key is None or dst.exists() or dst.is_symlink():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        src = assets[key]
        if not copy:
            dst.symlink_to(src, target_is_directory=src.is_dir())
        elif src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
    return root


def substitute(code: str, assets_root: Path, base_url: str | None, where: str) -> str:
    """Rewrite ``/path/to/<name>`` and ``localhost:8000`` (see the module docstring)."""
    unknown = sorted(
        {m[1].rstrip(".") for m in _PLACEHOLDER.finditer(code)} - set(PLACEHOLDERS) - PLACEHOLDER_DIRS
    )
    if unknown:
        raise AssertionError(
            f"{where}: unknown placeholder path(s) {['/path/to/' + u for u in unknown]}; "
            f"use one of {sorted(PLACEHOLDERS) + sorted(PLACEHOLDER_DIRS)} or add it to tests/docs/doc_blocks.py"
        )
    code = code.replace("/path/to/", f"{assets_root}/")
    if "localhost:8000" in code:
        if base_url is None:
            raise AssertionError(f"{where}: the block talks to localhost:8000 but no server was started")
        code = code.replace("http://localhost:8000", base_url).replace("localhost:8000", base_url[7:])
    return code


# ------------------------------------------------------------------ bash
def split_commands(code: str) -> list[str]:
    """Commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out, pending = [], ""
    for line in joined.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:  # a quoted argument (e.g. a JSON body) may span lines
            words = shlex.split(pending, comments=True)
        except ValueError:
            continue
        if words:
            out.append(pending.strip())
        pending = ""
    if pending:
        raise AssertionError(f"unbalanced quotes in bash block: {pending[:200]!r}")
    return out


def serve_argv(command: str) -> tuple[dict[str, str], list[str]] | None:
    """``(env assignments, argv for vllm_omni's CLI main)`` of a serve command, else ``None``."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[:2] == ["vllm-omni", "serve"] or (words[:2] == ["vllm", "serve"] and "--omni" in words):
        return env, words[1:]
    return None


@contextlib.contextmanager
def patched_env(env: dict[str, str]):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dry_run(env: dict[str, str], argv: list[str], where: str) -> dict:
    """Resolve a serve command through the real CLI with ``--dry-run`` (no engine starts)."""
    from vllm_omni.entrypoints.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with patched_env(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv if "--dry-run" in argv else [*argv, "--dry-run"])
        except SystemExit as exc:
            rc = exc.code
    if rc != 0:
        raise AssertionError(f"{where}: `{shlex.join(argv)}` does not resolve (exit {rc}): {err.getvalue()}")
    return json.loads(out.getvalue())


class LiveServer:
    """The serve command's server, in this process (uvicorn in a thread, engines in-process)."""

    def __init__(self, env: dict[str, str], argv: list[str]):
        import asyncio

        import uvicorn

        from vllm_omni.entrypoints.async_omni import AsyncOmni
        from vllm_omni.entrypoints.cli.main import make_parser
        from vllm_omni.entrypoints.cli.serve import split_serve_args
        from vllm_omni.entrypoints.openai.api_server import build_app, make_state, register_startup_adapters

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self._env = patched_env(env)
        self._env.__enter__()  # e.g. VLLM_ALLOW_RUNTIME_LORA_UPDATING, read by build_app
        launch, settings = split_serve_args(make_parser().parse_args(argv))
        self.omni = AsyncOmni(launch.model, **launch.omni_kwargs())
        state = make_state(self.omni, settings)
        asyncio.run(register_startup_adapters(state))
        config = uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.stop()
                raise AssertionError(f"server {shlex.join(argv)} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.omni.shutdown()
        self._env.__exit__(None, None, None)


def run_curl(command: str, cwd: Path, expect_error: bool, where: str) -> list[Any]:
    """Run one curl command; every JSON document it prints is checked (error object or not)."""
    if shutil.which("curl") is None:
        raise AssertionError(f"{where}: curl is not installed (apt-get install curl)")
    proc = subprocess.run(
        ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(f"{where}: `{command}` failed ({proc.returncode}): {proc.stderr}")
    docs = []
    decoder = json.JSONDecoder()
    text = proc.stdout.strip()
    while text:
        try:
            doc, end = decoder.raw_decode(text)
        except json.JSONDecodeError:
            if text.startswith("Success"):  # the admin routes answer plain text
                docs.append(text.splitlines()[0])
                text = "\n".join(text.splitlines()[1:]).strip()
                continue
            raise AssertionError(f"{where}: `{command}` printed non-JSON output: {text[:300]!r}") from None
        docs.append(doc)
        text = text[end:].strip()
    if not docs:
        raise AssertionError(f"{where}: `{command}` printed nothing")
    for doc in docs:
        print(
            f"{where}: {command.split()[2] if len(command.split()) > 2 else command} -> {json.dumps(doc)[:160]}"
        )
        is_error = isinstance(doc, dict) and "error" in doc
        if is_error != expect_error:
            want = "an error object" if expect_error else "a success reply"
            raise AssertionError(f"{where}: `{command}` should print {want}, got {json.dumps(doc)[:500]}")
    return docs


# ------------------------------------------------------------------ pages
class PageRunner:
    """Runs one page's blocks in order (one Python namespace, at most one live server)."""

    def __init__(self, page: str, assets_root: Path, workdir: Path):
        self.page = page
        self.assets_root = assets_root
        self.workdir = workdir
        self.namespace: dict[str, Any] = {"__name__": "__main__"}
        self.server: LiveServer | None = None
        self.ran: list[str] = []
        self.skipped: list[str] = []

    def run(self, blocks: list[Block]) -> None:
        old_cwd = os.getcwd()
        os.chdir(self.workdir)
        try:
            for block in blocks:
                self.run_block(block)
        finally:
            os.chdir(old_cwd)
            self.close()

    def run_block(self, block: Block) -> None:
        if "skip" in block.markers:
            if not block.markers["skip"]:
                raise AssertionError(f"{block.where}: `docs-test: skip` needs a reason")
            self.skipped.append(f"{block.where} ({block.markers['skip']})")
            return
        if block.lang in NEVER_RUN_LANGS:
            return
        if block.lang not in RUN_LANGS:
            raise AssertionError(
                f"{block.where}: cannot run a {block.lang or 'plain'!r} block; use one of {sorted(RUN_LANGS)}, "
                f"'text' for output, or mark it `<!-- docs-test: skip <reason> -->`"
            )
        base_url = self.server.base_url if self.server else None
        code = substitute(block.code, self.assets_root, base_url, block.where)
        if "file" in block.markers:
            (self.workdir / block.markers["file"]).write_text(code)
        if block.lang == "python":
            # padded so that tracebacks name the page's own line numbers (and show them)
            filename = str(DOCS_DIR / block.page)
            padded = "\n" * block.line + code
            linecache.cache[filename] = (len(padded), None, padded.splitlines(True), filename)
            exec(compile(padded, filename, "exec"), self.namespace)
        elif block.lang in ("yaml", "yml"):
            import yaml

            yaml.safe_load(code)
        elif block.lang == "json":
            json.loads(code)
        else:
            self.run_bash(block, code)
        self.ran.append(block.where)

    def run_bash(self, block: Block, code: str) -> None:
        commands = split_commands(code)
        if not commands:
            raise AssertionError(f"{block.where}: empty bash block")
        for command in commands:
            serve = serve_argv(command)
            if serve is not None:
                dry_run(*serve, block.where)
                if "serve" in block.markers:
                    if len(commands) != 1:
                        raise AssertionError(f"{block.where}: a `serve` block holds exactly one command")
                    if self.server is not None:
                        self.server.stop()
                        self.server = None
                    self.server = LiveServer(*serve)
            elif shlex.split(command)[0] == "curl":
                if self.server is None:
                    raise AssertionError(f"{block.where}: curl needs a `docs-test: serve` block before it")
                run_curl(command, self.workdir, "expect-error" in block.markers, block.where)
            else:
                raise AssertionError(
                    f"{block.where}: cannot check `{command}`; only serve commands and curl (against a "
                    f"served block) run; otherwise mark the block `<!-- docs-test: skip <reason> -->`"
                )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        module = sys.modules.get("vllm_omni.entrypoints.omni_base")  # not imported: no engine ran
        for value in list(self.namespace.values()) if module else ():  # engines a page left running
            if isinstance(value, module.OmniBase):
                with contextlib.suppress(Exception):
                    value.shutdown()
        self.namespace.clear()
