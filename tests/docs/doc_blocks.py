"""Run the fenced code blocks of ``README.md`` and ``docs/**/*.md`` on the tiny test models.

Conventions (also described in ``docs/contributing_docs.md``):

* **Placeholders.** Every ``/path/to/<name>`` in a block is rewritten to ``<assets>/<name>``, a
  directory the test builds from the tiny test assets (see :data:`PLACEHOLDERS`). A name that
  is not listed there fails the test, so the docs cannot use a path nobody checks.
  ``localhost:8000`` is rewritten to the address of the page's live server (``serve`` below).
  Paths under ``examples/`` and ``.cache/test_assets/`` (the tiny model and adapters the main job
  writes) resolve as from the repository's root (the page folder links them).
* **Languages.** ``python``: every block is a script of its own, run as a reader would run it
  (``python block.py`` in a fresh per-page folder, a new process, ``VLLM_ENABLE_V1_MULTIPROCESSING``
  unset as in a fresh shell), so a block defines every name it
  uses and guards engine code with ``if __name__ == "__main__":``. ``bash`` / ``sh`` /
  ``shell``: every command must be one this module can check (:meth:`PageRunner.run_bash`).
  ``yaml`` / ``json``: parsed. ``text``: literal output or synopsis, never run. Anything else
  fails.
* **Markers.** An HTML comment on the line(s) right before a fence:
  ``<!-- docs-test: skip <reason> -->`` (not run; a reason is required),
  ``<!-- docs-test: file <name> -->`` (write the block to ``<name>`` in the page folder),
  ``<!-- docs-test: serve -->`` (a bash block with one serve command: also start that server,
  as its own process, for the rest of the page; one server per page at a time),
  ``<!-- docs-test: expect-error -->`` (the block's curl replies must be OpenAI error
  objects; by default they must not be), ``<!-- docs-test: continues -->`` (a Python block
  that continues the script of the Python block before it, as the page's text must say: the
  chain runs as one script, each block at its own line numbers).
* **Waiting.** Nothing runs against a wall-clock budget: a block's script, a server's start
  and its stop are waited on while they make progress (new output, or CPU time used by the
  process tree) and fail after :data:`STALL_S` seconds without any while every thread of the
  tree sleeps (time spent waiting for a CPU on a loaded machine does not count), showing the
  last output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import preload
from tests.entrypoints.server_utils import HTTP

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS_DIR = REPO_ROOT / "docs"
#: Seconds a block, a server start or a server stop may go without output or CPU time.
STALL_S = float(os.environ.get("VLLM_OMNI_DOCS_STALL_S", "300"))
#: What the main job (``tools/setup.sh``) writes, as the first pages name it: ``.cache/test_assets/...``
#: from the repository's root (the suite's assets folder: the same place unless ``VLLM_OMNI_TEST_ASSETS``).
SHIPPED_ASSETS = Path(os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO_ROOT / ".cache" / "test_assets")
#: An engine built on an LLM checkpoint: the script needs the ``__main__`` guard (vLLM spawns processes).
_ENGINE_LLM = re.compile(
    r"\b(Omni|AsyncOmni)\(\s*\"(/path/to/(model|qwen2_5_omni|qwen3_omni)|\.cache/test_assets/tiny_llm_v\d+/model)\""
)
_MAIN_GUARD = re.compile(r"""^if __name__ == ["']__main__["']:""", re.M)

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<body>.*?)\s*-->")
_PLACEHOLDER = re.compile(r"/path/to/([A-Za-z0-9_.\-/]+)")
RUN_LANGS = {"python", "bash", "sh", "shell", "yaml", "yml", "json"}
NEVER_RUN_LANGS = {"text", "mermaid"}
KNOWN_MARKERS = {"skip", "file", "serve", "expect-error", "continues"}

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
    "qwen_image": ("qwen_image", False),  # tiny Qwen-Image diffusers directory
    "qwen_image_edit": ("qwen_image_edit", False),  # the same weights as QwenImageEditPipeline (+ processor)
    "qwen_image_loras/style.safetensors": ("qwen_image_kohya", True),  # kohya / musubi file, attention
    "qwen_image_loras/detail": ("qwen_image_mlp", True),  # PEFT, r 4, MLPs and txt_mod
    "flux": ("flux_dev", False),  # tiny FLUX.1-dev diffusers directory (tools/make_tiny_flux.py)
    "flux_loras/style.safetensors": ("flux_kohya", True),  # kohya sd-scripts file (BFL names), double blocks
    "flux_loras/detail": ("flux_mlp", True),  # PEFT, r 4, MLPs, single-block modulation, context_embedder
    "wan2.2": ("wan_moe", False),  # tiny Wan2.2-style two-expert directory (tools/make_tiny_wan.py --moe)
    "wan2.2-ti2v-5b": ("wan_ti2v", False),  # tiny TI2V-5B folder, WanPipeline + expand_timesteps (--ti2v)
    "wan_loras/high_noise.safetensors": ("wan_high", True),  # diffusers-format file for transformer
    "wan_loras/low_noise.safetensors": ("wan_low", True),  # diffusers-format file for transformer_2
    "qwen2_5_omni": ("omni_model", False),  # tiny Qwen2.5-Omni checkpoint
    "qwen2_5_omni_loras/thinker": ("omni_thinker_adapter", True),  # PEFT, whole-model keys
    "qwen3_omni": ("qwen3_omni_model", False),  # tiny Qwen3-Omni checkpoint (MoE thinker)
    "qwen3_omni_loras/thinker": ("qwen3_omni_thinker_adapter", True),  # PEFT, thinker attention
    "qwen3_omni_loras/talker": ("qwen3_omni_talker_adapter", True),  # PEFT on model.talker
    "does_not_exist": (None, False),  # never created: for examples of errors
}
# folders that exist because their entries do (usable as --lora-dirs roots)
PLACEHOLDER_DIRS = {
    "llm_loras",
    "z_image_loras",
    "qwen2_5_omni_loras",
    "qwen3_omni_loras",
    "qwen_image_loras",
    "flux_loras",
    "wan_loras",
}


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
    page = str(path.relative_to(REPO_ROOT))
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
    """The README and every docs page."""
    return [REPO_ROOT / "README.md", *sorted(DOCS_DIR.rglob("*.md"))]


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


# ------------------------------------------------------------------ processes
def block_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A reader's environment: the suite's vLLM settings unset, this checkout importable."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the test suite's in-process setting, not a reader's
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # as in a fresh shell: the KV budget is automatic
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _tree_sample(pid: int) -> tuple[float, bool]:
    """``(cpu_s, busy)`` of ``pid`` and its live descendants: CPU seconds used so far, and whether
    the tree can be waiting for anything but itself.

    ``busy``: a thread is runnable (``R``: running or waiting for a CPU on a loaded machine) or in
    uninterruptible sleep (``D``: disk), or ``pid`` itself has exited (a zombie, or already reaped
    while its exit status is on its way to us). Only a tree whose every thread sleeps in ``S`` (or
    is stopped) can be stalled. The tree includes the workers of the zygotes' shared fork servers
    (``tests/preload.py``): a forked command's stage workers are their children, and only this
    test's commands run workers meanwhile.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        if root.status() == psutil.STATUS_ZOMBIE:
            return 0.0, True
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, True  # gone: it exited
    for server in preload.shared_fork_servers():
        with contextlib.suppress(psutil.Error):
            procs += psutil.Process(server).children(recursive=True)
    total, busy = 0.0, False
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
        busy = busy or _any_thread_busy(proc.pid)
    return total, busy


def _any_thread_busy(pid: int) -> bool:
    """A thread of ``pid`` is in state ``R`` or ``D`` (``/proc/<pid>/task/*/stat``)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("R", "D"):
            return True
    return False


def _kill_tree(proc: subprocess.Popen) -> None:
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    with contextlib.suppress(OSError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_on_progress(proc: subprocess.Popen, log: Path, what: str, until=None) -> int | None:
    """Wait for ``proc`` to exit (its status) or for ``until()`` to hold (``None``).

    Fails (killing the process tree) only after :data:`STALL_S` seconds *asleep*: no new output in
    ``log``, no CPU time used by the process tree, and every thread of the tree sleeping (see
    :func:`_tree_sample`). Time the tree spends runnable but without a CPU (a loaded machine), in
    disk waits or exiting never counts, so how busy the machine is cannot fail a block; the
    message shows what was last seen.
    """
    seen, asleep_s, asleep_since = (-1, -1.0), 0.0, None
    while True:
        if until is not None and until():
            return None
        status = proc.poll()
        if status is not None:
            return status
        size = log.stat().st_size if log.exists() else 0
        cpu, busy = _tree_sample(proc.pid)
        now = time.monotonic()
        if size != seen[0] or cpu > seen[1] + 0.2:
            seen, asleep_s, asleep_since = (size, cpu), 0.0, None
        elif busy:
            asleep_since = None
        else:  # counted only between two samples that both found the tree asleep and unchanged
            asleep_s += 0.0 if asleep_since is None else now - asleep_since
            asleep_since = now
            if asleep_s > STALL_S:
                _kill_tree(proc)
                raise AssertionError(
                    f"{what}: no output, no CPU time and every thread asleep for {STALL_S:.0f} s (stalled); "
                    f"its output ends:\n{tail(log)}"
                )
        time.sleep(0.25)


def _without_address(argv: list[str]) -> list[str]:
    """``argv`` without ``--host`` / ``--port`` (the test picks a free loopback port)."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in ("--host", "--port"):
            skip = True
        elif not word.startswith(("--host=", "--port=")):
            out.append(word)
    return out


class LiveServer:
    """The serve command's server as its own process (as documented, on a free loopback port)."""

    def __init__(self, env: dict[str, str], argv: list[str], workdir: Path, where: str):
        from tests.entrypoints.server_utils import free_port, port_taken

        self.where = where
        self.log = workdir / f"server_{where.rsplit(':', 1)[-1]}.log"
        started = time.monotonic()
        for attempt in range(3):  # another process may take the port before the server binds it
            port = free_port()
            self.base_url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", *_without_address(argv)]
            cmd += ["--host", "127.0.0.1", "--port", str(port)]
            with open(self.log, "w") as out:
                self.proc = preload.popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=block_env(env)
                )  # fmt: skip
            status = wait_on_progress(self.proc, self.log, f"{where}: server start", until=self._healthy)
            if status is None:
                break
            if attempt == 2 or not port_taken(tail(self.log)):
                raise AssertionError(f"{where}: `{shlex.join(argv)}` exited with {status}:\n{tail(self.log)}")
        self.start_s = time.monotonic() - started

    def _healthy(self) -> bool:
        import httpx

        try:
            return HTTP.get(self.base_url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """SIGTERM, then wait for the exit while the server makes progress."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            wait_on_progress(self.proc, self.log, f"{self.where}: server stop")


def run_curl(command: str, cwd: Path, expect_error: bool, where: str) -> list[Any]:
    """Run one curl command; every JSON document it prints is checked (error object or not).

    The 900 s bound only ends a curl that hangs: the server behind it is the page's live one, whose
    start was waited on progress; a request on the tiny models takes seconds.
    """
    if shutil.which("curl") is None:
        raise AssertionError(f"{where}: curl is not installed (apt-get install curl)")
    proc = subprocess.run(
        ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(f"{where}: `{command}` failed ({proc.returncode}): {proc.stderr}")
    if "|" in shlex.split(command):  # piped into a filter (e.g. `| grep` on /metrics): plain text
        if not proc.stdout.strip():
            raise AssertionError(f"{where}: `{command}` printed nothing")
        print(f"{where}: {command} ->\n{proc.stdout.strip()[:500]}")
        return [proc.stdout]
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
    """Runs one page's blocks in order (each Python block a script; at most one live server)."""

    def __init__(self, page: str, assets_root: Path, workdir: Path):
        self.page = page
        self.assets_root = assets_root
        self.workdir = workdir
        # a reader runs the documented commands from the repository's root: its paths resolve
        for top in ("examples",):
            if not (workdir / top).exists():
                (workdir / top).symlink_to(REPO_ROOT / top, target_is_directory=True)
        # ... and so does what the main job wrote there (the tiny model the first pages use)
        shipped = workdir / ".cache" / "test_assets"
        if not shipped.exists():
            shipped.parent.mkdir(exist_ok=True)
            shipped.symlink_to(SHIPPED_ASSETS, target_is_directory=True)
        self.server: LiveServer | None = None
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self.seconds: dict[str, float] = {}  # where -> wall seconds (scripts, server starts)
        self.script: list[tuple[Block, str]] = []  # the Python chain not run yet (``continues``)

    def run(self, blocks: list[Block]) -> None:
        try:
            for block in blocks:
                self.run_block(block)
            self.flush()
        finally:
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
            if "continues" not in block.markers:
                self.flush()
            elif not self.script:
                raise AssertionError(f"{block.where}: `docs-test: continues` but no Python block before it")
            self.script.append((block, code))
            return
        self.flush()
        if block.lang in ("yaml", "yml"):
            import yaml

            yaml.safe_load(code)
        elif block.lang == "json":
            json.loads(code)
        else:
            self.run_bash(block, code)
        self.ran.append(block.where)

    def flush(self) -> None:
        """Run the pending Python chain (a block and its ``continues`` blocks) as one script."""
        chain, self.script = self.script, []
        if not chain:
            return
        block = chain[0][0]
        written = "".join(b.code for b, _ in chain)  # as on the page, before placeholders
        if _ENGINE_LLM.search(re.sub(r"#.*", "", written)) and not _MAIN_GUARD.search(written):
            raise AssertionError(
                f'{block.where}: a block that builds an LLM engine needs `if __name__ == "__main__":` '
                f"(vLLM's CPU engine starts its processes with spawn, which imports the script again)"
            )
        lines = [f"# {block.where}"]
        for part, text in chain:  # each block at its page line numbers, so tracebacks name them
            lines += [""] * (part.line - len(lines))
            lines += text.splitlines()
        self.run_python(block, "\n".join(lines) + "\n", len(chain))

    def run_python(self, block: Block, source: str, blocks: int = 1) -> None:
        """``python block_<line>.py`` in the page folder, a new process, as a reader would run it
        (forked from a preloaded interpreter where ``tests/preload.py`` allows)."""
        script = self.workdir / f"block_{block.line}.py"
        script.write_text(source)
        log = self.workdir / f"block_{block.line}.log"
        started = time.monotonic()
        with open(log, "w") as out:
            proc = preload.popen(
                [sys.executable, script.name], stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir, env=block_env()
            )  # fmt: skip
        status = wait_on_progress(proc, log, f"{block.where}: python {script.name}")
        self.seconds[block.where] = time.monotonic() - started
        print(f"{block.where}: python script ({blocks} block(s)), {self.seconds[block.where]:.1f} s")
        if status != 0:
            raise AssertionError(
                f"{block.where}: `python {script.name}` exited with {status}; its output ends:\n{tail(log, 60)}"
            )

    def run_bash(self, block: Block, code: str) -> None:
        commands = split_commands(code)
        if not commands:
            raise AssertionError(f"{block.where}: empty bash block")
        for command in commands:
            serve = serve_argv(command)
            if serve is not None:
                with contextlib.chdir(self.workdir):  # relative files (a deploy YAML) as the reader's
                    dry_run(*serve, block.where)
                if "serve" in block.markers:
                    if len(commands) != 1:
                        raise AssertionError(f"{block.where}: a `serve` block holds exactly one command")
                    if self.server is not None:
                        self.server.stop()
                        self.server = None
                    self.server = LiveServer(*serve, self.workdir, block.where)
                    self.seconds[block.where] = self.server.start_s
                    print(f"{block.where}: server up in {self.server.start_s:.1f} s")
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
            server, self.server = self.server, None
            server.stop()
