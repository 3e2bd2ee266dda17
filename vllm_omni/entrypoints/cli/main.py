"""Entry point of the ``vllm-omni`` console script and of ``vllm ... --omni``.

vLLM's own CLI (``vllm.entrypoints.cli.main``) checks ``sys.argv`` for ``--omni`` before
parsing anything and, when it is there, calls :func:`main` here with ``sys.argv``
untouched. So ``vllm serve <model> --omni [flags]`` and ``vllm-omni serve <model> [flags]``
run the same code; ``--omni`` itself is accepted and ignored.

This module imports neither vLLM nor torch: ``--version``, ``--help`` and every mistake the
flags and files show are answered by :mod:`vllm_omni.entrypoints.cli.fast`; the full parser
(which needs vLLM's ``EngineArgs``) is built only for everything else.
"""

from __future__ import annotations

import logging
import os
import sys

from vllm_omni import log_noise
from vllm_omni.entrypoints import prestart
from vllm_omni.entrypoints.cli import fast


def make_parser():
    """The ``vllm-omni`` parser with its ``serve`` subcommand (imports vLLM)."""
    # here, not at the top: ``serve`` imports vLLM and torch (seconds), which the cached answers
    # of ``fast`` avoid (tests/entrypoints/test_cli.py: --help in well under 3 s, no vLLM)
    from vllm_omni.entrypoints.cli.flags import DESCRIPTION, USAGE
    from vllm_omni.entrypoints.cli.serve import OmniArgumentParser, make_serve_parser

    parser = OmniArgumentParser(prog="vllm-omni", description="vllm-omni command line", allow_abbrev=False)
    sub = parser.add_subparsers(dest="subcommand")
    serve = sub.add_parser(
        "serve",
        usage=USAGE,
        help="Start the OpenAI-compatible server for a pipeline.",
        description=DESCRIPTION,
        allow_abbrev=False,
    )
    make_serve_parser(serve)
    parser.serve_parser = serve
    return parser


def configure_logging() -> None:
    """Show ``vllm_omni``'s log records (INFO and up) on stdout, as vLLM does for its own logger.

    Only the command line does this (it is an application); a library user keeps control of
    logging. ``VLLM_CONFIGURE_LOGGING=0`` turns it off and ``VLLM_LOGGING_LEVEL`` sets the
    level, as for vLLM.
    """
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("vllm_omni")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
    )
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand (``serve``); ``argv`` defaults to ``sys.argv[1:]``."""
    command = argv is None  # the console script (not a caller in this process, such as a test)
    argv = list(sys.argv[1:] if argv is None else argv)
    answered = fast.try_fast(argv, make_parser)
    if answered is not None:  # as argparse would: exit, except for the bare command
        if argv:
            raise SystemExit(answered)
        return answered
    if argv[:1] == [
        "serve"
    ]:  # before vLLM's import (its import-time notes); run as the command: its children too
        log_noise.install(children=command)
        prestart.start_worker_server(argv)  # mp workers' imports overlap with ours (prestart.py)
    parser = make_parser()
    fast.save(parser, parser.serve_parser)
    args = parser.parse_args(argv)
    if args.subcommand == "serve":
        from vllm_omni.entrypoints.cli.serve import run_serve  # (see make_parser: vLLM, torch)

        configure_logging()
        # vLLM's CPU worker sets this in the process it runs in; inherited from a parent that ran an
        # engine in-process it is stale, and vLLM warns about it as an unknown variable
        os.environ.pop("VLLM_DIST_IDENT", None)
        run_serve(args)
        return 0
    parser.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
