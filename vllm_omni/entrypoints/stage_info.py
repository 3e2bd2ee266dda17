"""A small public description of a pipeline's entry stage, for front ends.

The HTTP server (and any other front end) needs to know what a pipeline answers and which
adapters a request may carry, but not how stages are configured or run.
:func:`describe_entry_stage` reads the resolved :class:`~vllm_omni.config.VllmOmniConfig`
once and returns an :class:`EntryStageInfo`; ``Omni`` / ``AsyncOmni`` expose it as
``entry_stage_info``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from vllm_omni.config.diffusion import IN_TREE_PIPELINES
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.engine.stage_registry import default_stage_params, stage_params_type
from vllm_omni.lora.request import LoRARequest, startup_lora_request
from vllm_omni.stages import register_stage_runtimes
from vllm_omni.stages.qwen2_5_omni.code2wav import load_speakers

OutputKind = Literal["text", "image", "video", "audio"]

# Pipeline classes (``model_arch`` of a diffusion stage) that produce video, not images.
_VIDEO_CLASS = re.compile(r"(Video|Wan|Mochi|LTX|Allegro|Latte)", re.IGNORECASE)


@dataclass(frozen=True)
class EntryStageInfo:
    """What a front end needs to know about a pipeline (entry stage first).

    Attributes:
        pipeline: registered name of the resolved pipeline.
        model: the pipeline's default model path (``None`` when only stages name one).
        label: the entry stage's label, e.g. ``"Stage 0 (llm_ar)"``.
        is_llm: whether the entry stage is an LLM stage (else diffusion).
        model_arch: the entry stage's model / pipeline class name (``None``: derived later).
        stage_is_llm: per stage, in stage-id order, whether it is an LLM stage.
        output_kinds: the kinds final-output stages produce (``"text"``, ``"image"``, ``"video"``,
            ``"audio"``).
        stage_is_audio: per stage, in stage-id order, whether it makes audio (takes ``AudioParams``).
        voices: the voices an audio stage offers (its checkpoint's ``spk_dict.pt``), else empty.
        entry_final_output: whether the caller receives the entry stage's output.
        stage_defaults: per stage, the params a front end gives it when a request has none of
            its own (a talker's sampling, code2wav's ``AudioParams``), else ``None``.
        max_adapters_per_request: 1 on an LLM entry stage (vLLM applies one adapter per
            request), ``max_loras`` on a diffusion one.
        startup_lora_paths: the diffusion entry stage's ``lora_path`` entries, as given
            (any backend); requests may name these paths.
        startup_adapters: the ``LoRARequest`` s the entry stage pre-loads and pins
            (``lora_path`` with the ``peft`` backend); empty otherwise.
        startup_lora_scale: the default scale of ``startup_adapters`` (``lora_scale``).
        accepts_input_image: whether the entry stage takes an input image (a diffusers
            pipeline; in-tree pipelines here are text-to-image).
        max_model_len: the LLM entry stage's ``max_model_len`` option (``None``: not set).
        tokenizer: tokenizer to template chat prompts with (LLM entry stage with a model).
        trust_remote_code: the LLM entry stage's ``trust_remote_code`` option.
    """

    pipeline: str
    model: str | None
    label: str
    is_llm: bool
    model_arch: str | None
    stage_is_llm: tuple[bool, ...]
    output_kinds: frozenset[OutputKind]
    max_adapters_per_request: int
    stage_is_audio: tuple[bool, ...] = ()
    voices: tuple[str, ...] = ()
    stage_defaults: tuple[Any, ...] = ()
    entry_final_output: bool = False
    startup_lora_paths: tuple[str, ...] = ()
    startup_adapters: tuple[LoRARequest, ...] = ()
    startup_lora_scale: float = 1.0
    accepts_input_image: bool = False
    max_model_len: int | None = None
    tokenizer: str | None = None
    trust_remote_code: bool = False

    @property
    def has_llm_stage(self) -> bool:
        return any(self.stage_is_llm)

    @property
    def has_diffusion_stage(self) -> bool:
        return not all(self.stage_is_llm)

    def default_lora_scale(self, lora_int_id: int) -> float:
        """The scale an adapter gets when a request names it without one.

        ``startup_lora_scale`` for a start-up adapter, 1.0 for any other.
        """
        if any(r.lora_int_id == lora_int_id for r in self.startup_adapters):
            return self.startup_lora_scale
        return 1.0


def _is_audio(stage) -> bool:
    kind = stage_params_type(stage)
    return kind is not None and kind.__name__ == "AudioParams"


def _voices(config: VllmOmniConfig) -> tuple[str, ...]:
    audio = [s for s in config.stages if _is_audio(s) and s.model]
    if not audio:
        return ()
    return tuple(load_speakers(audio[0].model))


def _output_kind(stage) -> OutputKind:
    if _is_audio(stage):
        return "audio"
    if stage.is_llm:
        return "text"
    return "video" if _VIDEO_CLASS.search(stage.model_arch or "") else "image"


def describe_entry_stage(config: VllmOmniConfig) -> EntryStageInfo:
    """Build the :class:`EntryStageInfo` of a resolved pipeline config.

    The one place that reads the entry stage's options for front ends.
    """
    register_stage_runtimes()
    entry = config.entry_stage
    common = {
        "pipeline": config.pipeline.name,
        "model": config.model,
        "label": entry.label,
        "is_llm": entry.is_llm,
        "model_arch": entry.model_arch,
        "stage_is_llm": tuple(s.is_llm for s in config.stages),
        "output_kinds": frozenset(_output_kind(s) for s in config.stages if s.final_output),
        "stage_is_audio": tuple(_is_audio(s) for s in config.stages),
        "voices": _voices(config),
        "stage_defaults": tuple(default_stage_params(s) for s in config.stages),
        "entry_final_output": bool(entry.final_output),
    }
    if entry.is_llm:
        options = entry.options
        max_len = options.get("max_model_len")
        return EntryStageInfo(
            **common,
            max_adapters_per_request=1,
            max_model_len=int(max_len) if max_len else None,
            tokenizer=(options.get("tokenizer") or entry.model) if entry.model else None,
            trust_remote_code=bool(options.get("trust_remote_code", False)),
        )
    dcfg = entry.diffusion_config
    paths = tuple(dcfg.startup_lora_paths)
    peft = dcfg.lora_backend == "peft"
    return EntryStageInfo(
        **common,
        max_adapters_per_request=dcfg.max_loras,
        startup_lora_paths=paths,
        startup_adapters=tuple(startup_lora_request(p) for p in paths) if peft else (),
        startup_lora_scale=float(dcfg.lora_scale),
        accepts_input_image=dcfg.pipeline_backend == "diffusers" or entry.model_arch not in IN_TREE_PIPELINES,
    )
