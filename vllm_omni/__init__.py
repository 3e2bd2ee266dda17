"""vllm_omni: multi-stage inference on vLLM (LLM and diffusion stages) with LoRA on every stage.

``import vllm_omni`` stays cheap: ``Omni`` and ``AsyncOmni`` are imported on first use.
"""

from typing import TYPE_CHECKING

from vllm_omni.log_noise import install_if_asked
from vllm_omni.version import __version__

install_if_asked()  # vLLM's known log noise demoted, one line per kind (log_noise.py)

__all__ = ["AsyncOmni", "Omni", "__version__"]

if TYPE_CHECKING:
    from vllm_omni.entrypoints.async_omni import AsyncOmni
    from vllm_omni.entrypoints.omni import Omni


def __getattr__(name: str):
    if name == "Omni":
        # on first use: ``import vllm_omni`` stays free of vLLM and torch (seconds to import)
        from vllm_omni.entrypoints.omni import Omni

        return Omni
    if name == "AsyncOmni":
        from vllm_omni.entrypoints.async_omni import AsyncOmni  # on first use (see above)

        return AsyncOmni
    raise AttributeError(f"module 'vllm_omni' has no attribute {name!r}")
