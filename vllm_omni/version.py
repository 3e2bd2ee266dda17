"""The version of vllm_omni (``vllm_omni.__version__``; ``GET /version`` reports it)."""

__version__ = "0.1.0"
