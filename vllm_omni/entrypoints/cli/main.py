"""Entry point of the ``vllm-omni`` console script and of ``vllm ... --omni``.

vLLM's own CLI (``vllm.entrypoints.cli.main``) checks ``sys.argv`` for ``--omni`` before
parsing anything and, when it is there, calls :func:`main` here with ``sys.argv``
untouched. So ``vllm serve <model> --omni [flags]`` and ``vllm-omni serve <model> [flags]``
run the same code; ``--omni`` itself is accepted and ignored.
"""

from __future__ import annotations

import sys

from vllm_omni.entrypoints.cli.serve import USAGE, make_serve_parser, run_serve


def make_parser():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm-omni", description="vllm-omni command line")
    sub = parser.add_subparsers(dest="subcommand")
    serve = sub.add_parser(
        "serve",
        usage=USAGE,
        help="Start the OpenAI-compatible server for a pipeline.",
        description="Start an OpenAI-compatible HTTP server over AsyncOmni.",
    )
    make_serve_parser(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand (``serve``); ``argv`` defaults to ``sys.argv[1:]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.subcommand == "serve":
        run_serve(args)
        return 0
    parser.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
