"""Answers the command line can give without importing vLLM or torch.

Building the ``serve`` parser needs vLLM's ``EngineArgs.add_cli_args``, and importing vLLM
imports torch (several seconds). So every time the full parser is built, its help texts and
its option table are written to a small JSON cache keyed by the vLLM install and this
package's command-line sources; later runs answer ``--help`` and unknown flags from it at
once. Anything else (a valid command line, a value to check, a cache miss) goes to the
full parser. The cache lives in ``$VLLM_OMNI_CACHE_ROOT`` (default
``$XDG_CACHE_HOME/vllm_omni`` or ``~/.cache/vllm_omni``); a failure to read or write it
only costs time.

Before any of that, a ``serve`` command line's start-up inputs (adapter paths, deploy YAML,
the port) are checked by :mod:`vllm_omni.entrypoints.cli.preflight`, so a missing adapter
folder or a port in use is refused at once, not after vLLM is imported and the engines load.

Only stdlib, :mod:`vllm_omni.errors` and the stdlib-only preflight module are imported here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from vllm_omni.entrypoints.cli import preflight
from vllm_omni.errors import ConfigError, did_you_mean

# Sources whose content changes the parser (the flags and their help texts).
_SOURCES = (
    "entrypoints/cli/main.py",
    "entrypoints/cli/serve.py",
    "entrypoints/cli/fast.py",
    "config/diffusion.py",
)
_PACKAGE = Path(__file__).resolve().parents[2]
_HELP = ("-h", "--help")


def cache_root() -> Path:
    """Folder of the command-line cache (see the module docstring)."""
    root = os.environ.get("VLLM_OMNI_CACHE_ROOT")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm_omni"


def _cache_file() -> Path | None:
    """The cache file of this Python, this vLLM install (its version and ``EngineArgs``
    source, by size and mtime, without importing it) and these command-line sources."""
    digest = hashlib.sha256(sys.version.encode())
    try:
        spec = find_spec("vllm")
        if spec is None or spec.origin is None:
            return None
        vllm_dir = Path(spec.origin).parent
        for name in ("_version.py", "engine/arg_utils.py", "utils/argparse_utils.py"):
            stat = (vllm_dir / name).stat()
            digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        for name in _SOURCES:
            digest.update((_PACKAGE / name).read_bytes())
    except (ImportError, OSError, ValueError):
        return None
    return cache_root() / f"cli-{digest.hexdigest()[:16]}.json"


def _width() -> int:
    return shutil.get_terminal_size().columns


def _value_kind(action: argparse.Action) -> int | str:
    """0: takes no value, 1: exactly one, "*": a variable number."""
    if action.nargs == 0:
        return 0
    if action.nargs is None:
        return 1
    return "*"


def save(parser: argparse.ArgumentParser, serve: argparse.ArgumentParser) -> None:
    """Record the help texts (at the current terminal width) and ``serve``'s option table."""
    path = _cache_file()
    if path is None:
        return
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    if str(_width()) in data.get("help", {}) and "options" in data:
        return  # already recorded
    data["options"] = {s: _value_kind(a) for a in serve._actions for s in a.option_strings}
    data["serve_usage"] = serve.format_usage()
    data.setdefault("help", {})[str(_width())] = {"root": parser.format_help(), "serve": serve.format_help()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass


def _load() -> dict[str, Any] | None:
    path = _cache_file()
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None


def unknown_flags_message(flags: list[str], known: Any) -> str:
    """``unknown option '--enable-loar' (did you mean '--enable-lora'?)`` for each flag."""
    return "; ".join(f"unknown option {f!r}{did_you_mean(f, known)}" for f in flags)


def unknown_flags(argv: list[str], options: dict[str, Any]) -> list[str]:
    """The ``--flags`` of ``argv`` that ``options`` (the cached table) does not know.

    Spellings the full parser also accepts are not reported: ``--flag=value``,
    ``--snake_case`` names and vLLM's dotted JSON forms (``--json-arg.key value``).
    """
    unknown, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        name, has_value, _ = token.partition("=")
        name = "--" + name[2:].replace("_", "-")
        if "." in name or "+" in name:
            continue
        kind = options.get(name)
        if kind is None:
            unknown.append(name)  # as the full parser reports it: dashes, no value
        elif kind == 1 and not has_value:
            skip = True
    return unknown


def try_fast(argv: list[str]) -> int | None:
    """Answer ``argv`` from the cache when it is ``--help`` or has unknown flags, and refuse a
    ``serve`` command line whose start-up inputs are wrong (:func:`preflight.check_argv`).

    Returns:
        The exit status when answered (help: 0, unknown flags or a bad input: 2, printed as
        argparse does); ``None`` when the full parser must run.
    """
    serve = bool(argv) and argv[0] == "serve" and not any(a in _HELP for a in argv[1:])
    data = _load()
    try:
        if serve:
            preflight.check_argv(argv[1:], bind=False)
        answered = _from_cache(argv, data)
        # the address last, once the cache showed every flag is known (a typo is reported first),
        # held for the server to listen on; without a cache (the first run) only checked, and
        # bound for good after the full parser checked the flags
        if answered is None and serve:
            preflight.bind_argv(argv[1:], hold=data is not None)
    except ConfigError as exc:
        sys.stderr.write(f"vllm-omni serve: error: {exc}\n")
        return 2
    return answered


def _from_cache(argv: list[str], data: dict[str, Any] | None) -> int | None:
    """``--help`` and unknown flags answered from the cache ``data`` (see :func:`try_fast`), else ``None``."""
    if data is None:
        return None
    helps = data.get("help", {}).get(str(_width()))
    if not argv or argv[0] in _HELP:
        if helps is None or (argv and len(argv) > 1):
            return None
        sys.stdout.write(helps["root"])
        return 0 if argv else 1
    if argv[0] != "serve":
        return None
    rest = argv[1:]
    if any(a in _HELP for a in rest) and helps is not None:
        sys.stdout.write(helps["serve"])
        return 0
    unknown = unknown_flags(rest, data.get("options", {}))
    if unknown:
        sys.stderr.write(data.get("serve_usage", ""))
        sys.stderr.write(f"vllm-omni serve: error: {unknown_flags_message(unknown, data['options'])}\n")
        return 2
    return None
