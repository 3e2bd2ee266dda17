"""Diffusion adapters handed over in memory (:class:`~vllm_omni.lora.tensor_request.TensorLoRARequest`).

The request's ``peft_config`` and ``lora_tensors`` go through the same reader as a PEFT folder
(:func:`.safetensors_format.adapter_from_state_dict` with peft's ``LoraConfig`` built by
:func:`vllm_omni.lora.adapter_files.lora_config_from_dict`): the same refusals (not LoRA, DoRA, bias,
unpaired or non-2-D tensors, NaN / inf, declared ranks that disagree with the tensors), the same
scaling rules, and binding to the model checks shapes and targets as for files. No file is written.
"""

from __future__ import annotations

from vllm_omni.diffusion.lora.adapter import LoRAAdapterWeights
from vllm_omni.diffusion.lora.safetensors_format import adapter_from_state_dict
from vllm_omni.lora.adapter_files import lora_config_from_dict
from vllm_omni.lora.tensor_request import TensorLoRARequest


def adapter_from_tensors(request: TensorLoRARequest) -> LoRAAdapterWeights:
    """The adapter of an in-memory request, as :func:`.loading.load_lora_adapter` gives a folder's.

    Returns:
        :class:`LoRAAdapterWeights`: module keys as given (``base_model.model.`` prefix resolved when
        binding), float32 CPU ``A [r, d_in]`` / ``B [d_out, r]``, scaling per peft's rules.

    Raises:
        LoRAFormatError: naming the adapter (``adapter '<name>' (id <id>, in memory)``) and the key.
    """
    config = lora_config_from_dict(request.peft_config, request.source)
    return adapter_from_state_dict(request.lora_tensors, source=request.source, config=config)
