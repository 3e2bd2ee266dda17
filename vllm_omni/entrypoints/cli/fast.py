"""Answers the command line can give without importing vLLM or torch.

``--version`` and ``--help`` are answered from :mod:`vllm_omni.entrypoints.cli.flags` (our own
flags, defined with the standard library). Building the full ``serve`` parser needs vLLM's
``EngineArgs.add_cli_args``, and importing vLLM imports torch (several seconds). So every time
the full parser is built, its option table, the kind and choices of each flag's value and
vLLM's flag groups are written to a small JSON cache keyed by the vLLM install and this
package's command-line sources; later runs answer unknown flags, bad values and the vLLM part
of ``--help`` from it at once. Anything else (a valid command line, a cache miss) goes to the
full parser. The cache lives in ``$VLLM_OMNI_CACHE_ROOT`` (default
``$XDG_CACHE_HOME/vllm_omni`` or ``~/.cache/vllm_omni``); a failure to read or write it
only costs time.

A ``serve`` command line's flags and the files they name (model folder, adapters, deploy YAML,
``--stage-overrides``, the port) are checked by :mod:`~vllm_omni.entrypoints.cli.argv_checks`
and :mod:`~vllm_omni.entrypoints.cli.preflight`, so such a mistake is refused at once, not
after vLLM is imported and the engines load.

Only stdlib, :mod:`vllm_omni.errors` and the stdlib-only modules of this package are imported here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from vllm_omni import log_noise
from vllm_omni.entrypoints.cli import argv_checks, flags, preflight
from vllm_omni.errors import ConfigError, did_you_mean

# Sources whose content changes the parser (the flags and their help texts).
_SOURCES = (
    "entrypoints/cli/main.py",
    "entrypoints/cli/serve.py",
    "entrypoints/cli/fast.py",
    "entrypoints/cli/flags.py",
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


def _value_kind(action: argparse.Action) -> int | str:
    """0: takes no value, 1: exactly one, "*": a variable number."""
    if action.nargs == 0:
        return 0
    if action.nargs is None:
        return 1
    return "*"


def value_rules(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """What the value of each one-value flag must be, e.g. ``{"--max-lora-rank": {"type": "int",
    "choices": [1, 8, ...]}}`` (flags parsed by vLLM's own functions are left to the full parser)."""
    rules: dict[str, dict[str, Any]] = {}
    for action in parser._actions:
        if _value_kind(action) != 1 or action.type not in (None, str, int, float):
            continue
        rule: dict[str, Any] = {"type": getattr(action.type, "__name__", "str")}
        if action.choices is not None and all(isinstance(c, str | int | float) for c in action.choices):
            rule["choices"] = list(action.choices)
        if rule != {"type": "str"}:
            rules.update({flag: rule for flag in action.option_strings if flag.startswith("--")})
    return rules


def _kinds(parser: argparse.ArgumentParser) -> dict[str, int | str]:
    return {s: _value_kind(a) for a in parser._actions for s in a.option_strings}


def save(parser: argparse.ArgumentParser, serve: argparse.ArgumentParser) -> None:
    """Record ``serve``'s option table, its value rules, vLLM's flag groups and the defaults the
    checks need (vLLM is imported when this runs)."""
    path = _cache_file()
    if path is None or path.exists():
        return  # recorded already: the file's name is the key of what it records
    from vllm.engine.arg_utils import EngineArgs

    from vllm_omni.config.fields import STAGE_META_KEYS, STAGE_TYPES, owned_keys

    stage_keys = set(STAGE_META_KEYS).union(*(owned_keys(t) for t in STAGE_TYPES))
    data = {
        "options": _kinds(serve),
        "values": value_rules(serve),
        "serve_usage": serve.format_usage(),
        "engine_groups": flags.engine_groups(serve),
        "group_help": group_help(serve),
        "defaults": {"max_lora_rank": EngineArgs.max_lora_rank, "stage_keys": sorted(stage_keys)},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass


def group_help(serve: argparse.ArgumentParser) -> dict[str, str]:
    """``--help=<group>`` texts: each flag group's section as argparse formats it, by title."""
    out = {}
    for group in serve._action_groups:
        formatter = serve._get_formatter()
        formatter.start_section(group.title)
        formatter.add_text(group.description)
        formatter.add_arguments(group._group_actions)
        formatter.end_section()
        out[str(group.title)] = formatter.format_help()
    return out


def help_topic(topic: str, data: dict[str, Any] | None) -> str | None:
    """The text of ``serve --help=<topic>`` from the cache: ``all`` (every group), a group's title
    (any case), or the flags whose name contains ``topic``; ``None`` when the cache lacks it (the
    full parser answers)."""
    groups: dict[str, str] = (data or {}).get("group_help") or {}
    if not groups:
        return None
    if topic == "all":
        return "\n".join(groups.values())
    for title, text in groups.items():
        if title.lower() == topic.lower():
            return text
    word = topic.lower().lstrip("-").replace("_", "-")
    lines = []
    for text in groups.values():
        block: list[str] = []
        for line in text.splitlines():
            if line.startswith("  -"):
                if block and word in block[0].split()[0].lower():
                    lines += block
                block = [line]
            elif block and line.startswith("   "):
                block.append(line)
        if block and word in block[0].split()[0].lower():
            lines += block
    if lines:
        return "\n".join(lines) + "\n"
    known = ", ".join(groups)
    return f"no flag group or flag matches {topic!r}; groups: {known}\n"


def _load() -> dict[str, Any] | None:
    path = _cache_file()
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None


def unknown_flags_message(names: list[str], known: Any) -> str:
    """``unknown option '--enable-loar' (did you mean '--enable-lora'?)`` for each flag."""
    return "; ".join(
        argv_checks.RENAMED_FLAGS.get(f) or f"unknown option {f!r}{did_you_mean(f, known)}" for f in names
    )


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


def try_fast(argv: list[str], full_parser: Callable[[], Any]) -> int | None:
    """Answer ``argv`` when it asks for the version or help, has unknown flags (cache), or is a
    ``serve`` command line whose flags or files are wrong (:mod:`argv_checks`, :mod:`preflight`).

    Args:
        full_parser: builds the full parser (imports vLLM); called only for the vLLM part of
            ``serve --help`` on a cold cache, after our own flags were printed.

    Returns:
        The exit status when answered (version, help: 0; bare command: 1; unknown flags or a bad
        input: 2, printed as argparse does); ``None`` when the full parser must run.
    """
    if argv == ["--version"]:
        sys.stdout.write(flags.version_text())
        return 0
    if not argv or (argv[0] in _HELP and len(argv) == 1):
        sys.stdout.write(root_help())
        return 0 if argv else 1
    if argv[0] != "serve":
        return None
    rest = argv[1:]
    data = _load()
    topics = [a.partition("=")[2] for a in rest if a.startswith("--help=")]
    if topics:
        text = help_topic(topics[0], data)
        if text is not None:
            sys.stdout.write(text)
            return 0
        return None  # a cold cache: vLLM's parser answers
    if any(a in _HELP for a in rest):
        _serve_help(data, full_parser)
        return 0
    own = flags.own_parser()
    kinds, rules = _kinds(own), value_rules(own)
    if data is not None:
        kinds, rules = {**data.get("options", {}), **kinds}, {**data.get("values", {}), **rules}
    try:
        if data is not None:
            unknown = unknown_flags(rest, data.get("options", {}))
            if unknown:
                sys.stderr.write(data.get("serve_usage", ""))
                raise ConfigError(unknown_flags_message(unknown, data["options"]))
        argv_checks.check(rest, kinds, rules, (data or {}).get("defaults", {}))  # (preflight's files too)
        # the address last, once every flag is known to be right, held for the server to listen
        # on; without a cache (the first run) only checked, and bound for good after the full
        # parser checked the flags
        preflight.bind_argv(rest, hold=data is not None)
    except ConfigError as exc:
        sys.stderr.write(f"vllm-omni serve: error: {exc}\n")
        return 2
    return None


def root_help() -> str:
    """``vllm-omni --help``."""
    parser = argparse.ArgumentParser(prog="vllm-omni", description="vllm-omni command line")
    parser.add_argument("--version", action="store_true", help="Print the versions of vllm-omni and vLLM.")
    sub = parser.add_subparsers(dest="subcommand", title="commands")
    sub.add_parser("serve", help=flags.DESCRIPTION + " `vllm-omni serve --help` lists its flags.")
    return parser.format_help()


def _serve_help(data: dict[str, Any] | None, full_parser: Callable[[], Any]) -> None:
    """Our flags at once, then vLLM's flag groups (from the cache, else from the full parser)."""
    sys.stdout.write(flags.own_parser().format_help() + "\n")
    sys.stdout.flush()
    groups = (data or {}).get("engine_groups")
    if groups is None:
        log_noise.install()  # vLLM's import-time notes would follow the help text
        parser = full_parser()
        save(parser, parser.serve_parser)
        groups = flags.engine_groups(parser.serve_parser)
    try:
        sys.stdout.write(flags.engine_groups_help(groups))
        sys.stdout.flush()
    except BrokenPipeError:  # `serve --help | head`: the reader is gone; nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
