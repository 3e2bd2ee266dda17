"""LoRA for diffusion denoisers: request-time multi-LoRA (PEFT backend) and start-up fusing (distill).

Public entry points:

* :class:`DiffusionLoRAManager` (``manager.py``): patches the denoiser's linear layers, caches
  adapters, activates per-sample adapter sets and scales;
* :func:`fuse_lora_into_model` / :func:`fuse_lora_files_into_pipeline` (``fuse.py``): distill backend;
* :func:`load_lora_adapter` (``loading.py``): PEFT directory or single-file reader;
* :class:`LoRAScaleSchedule` (defined in :mod:`vllm_omni.lora.schedule`): per-step and per-block
  scales of one adapter in one request;
* :func:`lora_rows_per_sample`: tells the LoRA layers how ragged, concatenated inputs map to
  samples in a mixed batch (an alias of :func:`vllm_omni.diffusion.forward_context.rows_per_sample`,
  which models use: a model imports nothing from this package).

Internals: :mod:`.layers` (one LoRA layer class per layer kind, each owning its geometry),
:mod:`.ops` (shrink / expand), :mod:`.weights` and :mod:`.batch_state` (what the layers hold and read).
"""

from vllm_omni.diffusion.forward_context import rows_per_sample as lora_rows_per_sample
from vllm_omni.diffusion.lora.adapter import LoRAAdapterWeights, LoRAModuleWeights
from vllm_omni.diffusion.lora.fuse import fuse_lora_files_into_pipeline, fuse_lora_into_model
from vllm_omni.diffusion.lora.loading import load_lora_adapter, register_lora_format
from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager
from vllm_omni.diffusion.lora.targets import find_denoisers
from vllm_omni.errors import LoRACacheError, LoRAFormatError
from vllm_omni.lora.schedule import LoRAScaleSchedule, ScaleRange

__all__ = [
    "DiffusionLoRAManager",
    "LoRAAdapterWeights",
    "LoRACacheError",
    "LoRAFormatError",
    "LoRAModuleWeights",
    "LoRAScaleSchedule",
    "find_denoisers",
    "fuse_lora_files_into_pipeline",
    "fuse_lora_into_model",
    "load_lora_adapter",
    "lora_rows_per_sample",
    "register_lora_format",
    "ScaleRange",
]
