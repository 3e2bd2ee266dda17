"""``serve``: command-line flags -> typed pipeline config + HTTP server settings.

Flags come from three places:

- vLLM's own engine flags (``EngineArgs.add_cli_args``: ``--max-model-len``, ``--dtype``,
  ``--enable-lora``, ``--max-lora-rank``, ``--max-loras``, ``--max-cpu-loras``, ...). Only
  the flags given on the command line become options, exactly as if they were passed to
  ``Omni(model, **options)``; everything else keeps the typed config's defaults.
- vLLM's serving flags that apply here (``--host``, ``--port``, ``--api-key``,
  ``--served-model-name``, ``--lora-modules``, ``--chat-template``, ``--shutdown-timeout``, ...).
  They configure the HTTP server and never reach a stage.
- Omni flags: ``--pipeline``, ``--stage-overrides``, ``--deploy-config``, the diffusion LoRA
  flags (``--lora-path``, ``--lora-backend``, ``--lora-scale``) and the request allow-list
  (``--lora-dirs``, ``--allow-remote-lora``); ``--dry-run`` prints the resolved configuration
  and exits.

Everything that configures stages is resolved through
:func:`~vllm_omni.entrypoints.omni_base.build_omni_config`, so the command line fails with
the same errors as the Python API (e.g. global LoRA flags on a multi-stage pipeline).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.launchers.cli_args import LoRAParserAction
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_omni.entrypoints.cli import argv_checks, flags, preflight
from vllm_omni.entrypoints.cli.fast import unknown_flags_message
from vllm_omni.entrypoints.cli.flags import USAGE
from vllm_omni.entrypoints.launch import OmniLaunch
from vllm_omni.entrypoints.openai.settings import DEFAULT_SHUTDOWN_TIMEOUT_S, ServerSettings
from vllm_omni.errors import ConfigError, LoRAFormatError, ServeArgsError
from vllm_omni.lora.adapter_files import (
    ADAPTER_CONFIG_NAME,
    check_safetensors_header,
    locate_adapter,
    read_adapter_config,
)

# Dests of EngineArgs flags that configure the HTTP server, not a stage.
_FRONTEND_ENGINE_DESTS = ("served_model_name", "shutdown_timeout")


class OmniArgumentParser(FlexibleArgumentParser):
    """vLLM's parser (``--snake_case`` flags, ``--help=<topic>``, JSON dotted forms) with
    ``allow_abbrev=False`` and a spelling suggestion for each unknown flag, as for options."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        unknown = [a.partition("=")[0] for a in extras if a.startswith("--")]
        if unknown and self._subparsers is None:  # the leaf parser knows its options
            self.error(unknown_flags_message(unknown, [s for a in self._actions for s in a.option_strings]))
        return namespace, extras


def make_serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the ``serve`` flags to ``parser`` (a new :class:`OmniArgumentParser` when ``None``).

    vLLM's engine flags are added with suppressed defaults, so the parsed namespace holds
    only the engine flags that were actually given.
    """
    if parser is None:
        parser = OmniArgumentParser(prog="vllm-omni serve", usage=USAGE)
    flags.add_own_flags(parser, LoRAParserAction)
    ours = set(map(id, parser._actions))
    EngineArgs.add_cli_args(parser)
    engine_dests = []
    for action in parser._actions:
        if id(action) not in ours and action.dest != "help":
            action.default = argparse.SUPPRESS
            engine_dests.append(action.dest)
        if action.dest == "shutdown_timeout":  # vLLM's flag, same meaning; seconds may be fractional
            action.type, action.help = float, flags.SHUTDOWN_HELP
    parser.set_defaults(_engine_dests=tuple(engine_dests))
    return parser


def split_serve_args(args: argparse.Namespace) -> tuple[OmniLaunch, ServerSettings]:
    """Turn a parsed ``serve`` namespace into (what to build, how to serve it).

    Raises:
        ServeArgsError: ``--lora-backend distill`` without ``--lora-path``, no model, or a
            ``--port`` outside 0-65535.
        ConfigError: a missing or unreadable ``--lora-modules`` / ``--lora-path`` adapter or
            ``--lora-dirs`` directory (named as given). Those paths come back absolute, with
            symlinks resolved, as does ``--deploy-config``: resolved once, here.
    """
    ns = vars(args)
    engine = {k: ns[k] for k in ns.get("_engine_dests", ()) if k in ns}
    model = ns.get("model_tag") or engine.pop("model", None)
    engine.pop("model", None)
    served = engine.pop("served_model_name", None) or []
    shutdown_timeout = engine.pop("shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S)
    if isinstance(served, str):
        served = [served]
    options = dict(engine)
    if args.stage_overrides is not None:
        options["stage_overrides"] = args.stage_overrides
    if getattr(args, "worker_backend", None) is not None:
        options["worker_backend"] = args.worker_backend
    if args.lora_backend == "distill" and not args.lora_path:
        raise ServeArgsError(
            "--lora-backend distill fuses adapter weights at start-up and needs --lora-path "
            "<file.safetensors> [...]; pass --lora-path, or use --lora-backend peft for request-time adapters"
        )
    lora_paths = [_startup_adapter("--lora-path", p, p) for p in args.lora_path or []]
    if lora_paths:
        options["lora_path"] = lora_paths[0] if len(lora_paths) == 1 else lora_paths
    if args.lora_backend is not None:
        options["lora_backend"] = args.lora_backend
    if args.lora_scale is not None:
        options["lora_scale"] = args.lora_scale
    if model is None and args.deploy_config is None:
        raise ServeArgsError("no model given: vllm serve <model> --omni (or --deploy-config naming one)")
    try:
        preflight.check_port(args.port)
    except ConfigError as exc:
        raise ServeArgsError(str(exc)) from None
    if not shutdown_timeout >= 0:  # also refuses nan
        raise ServeArgsError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}")
    lora_dirs = [preflight.resolve_local("--lora-dirs", r, r, directory=True) for r in args.lora_dirs or []]
    lora_modules = [
        (m.name, _startup_adapter("--lora-modules", f"{m.name}={m.path}", m.path))
        for m in args.lora_modules or []
    ]
    if not args.deploy_config:
        _host_cache_for_startup_adapters(options, len(lora_modules))
    api_keys = list(args.api_key or [])
    if not api_keys and os.environ.get("VLLM_API_KEY"):
        api_keys = [os.environ["VLLM_API_KEY"]]
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_keys=api_keys,
        served_model_names=list(served),
        lora_modules=lora_modules,
        lora_dirs=lora_dirs,
        allow_remote_lora=bool(args.allow_remote_lora),
        prompt_lora_syntax=bool(getattr(args, "prompt_lora_syntax", False)),
        chat_template=args.chat_template,
        response_role=args.response_role,
        uvicorn_log_level=args.uvicorn_log_level,
        disable_uvicorn_access_log=bool(args.disable_uvicorn_access_log),
        shutdown_timeout=float(shutdown_timeout),
    )
    deploy = os.path.abspath(os.path.expanduser(args.deploy_config)) if args.deploy_config else None
    launch = OmniLaunch(model=model, pipeline=args.pipeline, deploy_config=deploy, options=options)
    return launch, settings


def _host_cache_for_startup_adapters(options: dict[str, Any], count: int) -> None:
    """``--lora-modules`` adapters count toward the LLM stage's host (CPU) adapter cache: without
    ``--max-cpu-loras`` it holds them all (at least ``--max-loras``), so switching between them never
    reads their files again (vLLM's default, ``max_loras``, evicted one at every switch)."""
    if count and options.get("enable_lora") and "max_cpu_loras" not in options:
        options["max_cpu_loras"] = max(count, int(options.get("max_loras") or 1))


def _startup_adapter(flag: str, value: str, path: str) -> str:
    """A start-up adapter's location, absolute with symlinks resolved (the spelling request paths
    and adapter ids use), after checking it is a readable safetensors adapter: its
    ``adapter_config.json`` (peft's rules) and the safetensors header (the tensors are read by the
    stage; what only the stage can tell, such as a rank above ``--max-lora-rank``, is refused once
    it loads).

    Raises:
        ConfigError: ``<flag> <value>: ...`` missing, unreadable, or not an adapter.
    """
    location = preflight.resolve_local(flag, value, path)
    shown = f"{flag} {value}"
    try:
        files = locate_adapter(location, shown=shown)
        if files.config is not None:
            read_adapter_config(files.config, source=f"{shown}: {ADAPTER_CONFIG_NAME}")
        weights = f"{shown}: {os.path.basename(files.weights)}" if files.is_directory else shown
        check_safetensors_header(files.weights, source=weights)
    except (FileNotFoundError, LoRAFormatError) as exc:
        raise ServeArgsError(str(exc)) from exc
    return location


def check_startup_adapters(config: Any, settings: ServerSettings) -> None:
    """``--lora-modules`` against the resolved stages (any pipeline, deploy YAML or overrides):
    some stage has LoRA enabled, and when every LoRA stage is an LLM stage, each adapter's rank
    (``adapter_config.json``) is within one of their ``max_lora_rank`` (the engines would refuse
    it only after loading).

    Raises:
        ServeArgsError: naming the adapter and the flag that fixes it.
    """
    if not settings.lora_modules:
        return
    # a diffusion stage always takes adapters (DiffusionLoRAManager); an LLM stage with enable_lora
    lora_stages = [s for s in config.stages if not s.is_llm or s.lora_config is not None]
    name, path = settings.lora_modules[0]
    if not lora_stages:
        raise ServeArgsError(
            f"--lora-modules {name}={path}: no stage has LoRA enabled; add --enable-lora (or enable_lora "
            "in --stage-overrides / the deploy YAML)"
        )
    given = [getattr(s.lora_config, "max_lora_rank", None) for s in lora_stages]
    limits = [int(limit) for limit in given if limit is not None]
    if any(s.stage_type != "llm_ar" for s in lora_stages) or len(limits) < len(given):
        return  # a stage that takes adapters of any rank
    for name, path in settings.lora_modules:
        rank = argv_checks.adapter_rank(path)
        if rank is not None and rank > max(limits):
            raise ServeArgsError(
                f"--lora-modules {name}={path}: adapter_config.json has rank {rank}, above the stages' "
                f"max_lora_rank {max(limits)}; pass --max-lora-rank {rank} or higher"
            )


def parse_serve_argv(argv: list[str]) -> tuple[OmniLaunch, ServerSettings]:
    """Parse ``serve`` arguments (without the ``serve`` word) into launch + settings."""
    args = make_serve_parser().parse_args(argv)
    return split_serve_args(args)


def _fail(message: str) -> None:
    print(f"vllm-omni serve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def describe_launch(config: Any, settings: ServerSettings) -> dict[str, Any]:
    """What ``--dry-run`` prints: every stage's resolved options and the HTTP settings."""
    stages = []
    for stage in config.stages:
        lora = stage.lora_config
        stages.append(
            {
                "stage_id": stage.stage_id,
                "stage_type": stage.stage_type,
                "model": stage.model,
                "model_arch": stage.model_arch,
                "options": stage.options,
                "lora_config": None if lora is None else repr(lora),
            }
        )
    server = {k: v for k, v in vars(settings).items() if k != "api_keys"}
    server["api_keys"] = len(settings.api_keys)  # how many, never the keys
    return {
        "pipeline": config.pipeline.name,
        "model": config.model,
        "worker_backend": config.worker_backend,
        "stages": stages,
        "server": server,
    }


def run_serve(args: argparse.Namespace) -> None:
    """Validate everything that can be checked without loading, then start the server on the
    config that was checked (``--dry-run``: print the resolved configuration instead).

    Raises:
        SystemExit: (2) after printing ``vllm-omni serve: error: ...`` for a flag or option error,
            or a start-up adapter the stages refuse once loaded (after they were shut down).
    """
    try:
        try:
            launch, settings = split_serve_args(args)
            config = launch.build_config()  # the typed config's errors, before any engine starts
            check_startup_adapters(config, settings)
        except (ValueError, KeyError) as exc:  # ConfigError (ServeArgsError included) is a ValueError
            _fail(str(exc))
        if getattr(args, "dry_run", False):
            print(json.dumps(describe_launch(config, settings), indent=2, default=str))
            return
        try:  # bound before vLLM was imported (fast path) and held since; else bound now
            listener = preflight.take_listener(settings.host, settings.port)
        except ConfigError as exc:
            _fail(str(exc))
    finally:  # what the fast path bound and this run will not serve on (a refusal, a caller's process)
        preflight.release_held()
    # only to serve: the server imports AsyncOmni and the engine (see OmniLaunch.build_config)
    from vllm_omni.entrypoints.openai.api_server import run_server

    try:
        run_server(config, settings, listener)  # the engines start from this very config: resolved once
    except ConfigError as exc:  # a start-up adapter the stages refused: one line, as the checks above
        _fail(str(exc))
