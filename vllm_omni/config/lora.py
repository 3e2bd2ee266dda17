"""``OmniStageLoRAConfig``: the typed vLLM LoRA options of one LLM stage."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, model_validator
from vllm.config import LoRAConfig
from vllm.config.utils import config

from vllm_omni.config.fields import lora_engine_field_map


@config(config=ConfigDict(arbitrary_types_allowed=True))
class OmniStageLoRAConfig(LoRAConfig):
    """vLLM's ``LoRAConfig`` owned by one LLM stage of a pipeline.

    A stage carries one only when its resolved options set ``enable_lora`` (as
    ``VllmConfig.lora_config`` in vLLM). Construction runs vLLM's own validation (rank
    in ``MaxLoRARanks``, ``max_loras >= 1``, ``max_cpu_loras >= max_loras``) with one
    difference: a non-positive ``max_cpu_loras`` means "unset" and becomes
    ``max_loras`` instead of failing the upstream comparison. Platform-dependent checks
    (dtype against the model, punica kernels) stay in the engine process.

    Raises:
        pydantic.ValidationError / ValueError: on an invalid field value.
    """

    @model_validator(mode="before")
    @classmethod
    def _non_positive_cpu_loras_is_unset(cls, data: Any) -> Any:
        kwargs = getattr(data, "kwargs", None)
        if isinstance(kwargs, dict):
            value = kwargs.get("max_cpu_loras")
            if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
                kwargs["max_cpu_loras"] = None
        elif isinstance(data, dict):
            value = data.get("max_cpu_loras")
            if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
                data["max_cpu_loras"] = None
        return data

    @classmethod
    def from_engine_options(cls, options: dict[str, Any]) -> OmniStageLoRAConfig:
        """Build from EngineArgs-named options (``lora_target_modules``, ``max_lora_rank``, ...).

        Keys that are not LoRA engine fields are ignored; ``enable_lora`` is implied.
        """
        inverse = {ea: field for field, ea in lora_engine_field_map().items()}
        kwargs = {inverse[k]: v for k, v in options.items() if k in inverse}
        return cls(**kwargs)

    @staticmethod
    def project_engine_args(options: dict[str, Any]) -> dict[str, Any]:
        """EngineArgs kwargs for a LoRA-enabled stage: ``enable_lora=True`` plus the LoRA
        options present in ``options`` (already EngineArgs-named), nothing else."""
        names = set(lora_engine_field_map().values())
        out: dict[str, Any] = {"enable_lora": True}
        out.update({k: v for k, v in options.items() if k in names})
        return out
