"""Typed inputs of vllm_omni stages."""

from vllm_omni.inputs.data import OmniDiffusionSamplingParams

__all__ = ["OmniDiffusionSamplingParams"]
