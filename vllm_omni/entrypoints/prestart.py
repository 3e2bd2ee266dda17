"""Work a command can start before it imports vLLM: the ``mp`` workers' preloaded interpreter.

The command line (``vllm-omni serve``, ``vllm serve --omni``) calls :func:`start_worker_server`
first thing, so the fork server of :mod:`vllm_omni.worker_start` imports torch and vLLM
on another core while the command imports them to parse its flags. This module imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence


def start_worker_server(argv: Sequence[str]) -> bool:
    """Start the worker fork server now unless ``argv`` names ``--worker-backend inline`` / ``ray``
    (no ``mp`` worker will start) or ``VLLM_OMNI_WORKER_START`` chooses ``spawn``. A bad
    ``VLLM_OMNI_WORKER_START`` is left for the first worker start to report.

    Returns:
        True when a fork server runs.
    """
    args = list(argv)
    for i, arg in enumerate(args):
        value = arg.partition("=")[2] if arg.startswith("--worker-backend=") else None
        if arg == "--worker-backend" and i + 1 < len(args):
            value = args[i + 1]
        if value in ("inline", "ray"):
            return False
    from vllm_omni import worker_start as start

    try:
        return start.start_preloaded()
    except ValueError:
        return False
