"""Command line: ``vllm serve <model> --omni`` / ``vllm-omni serve <model>``."""
