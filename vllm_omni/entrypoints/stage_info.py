"""A small public description of a pipeline's entry stage, for front ends.

The HTTP server (and any other front end) needs to know what a pipeline answers and which
adapters a request may carry, but not how stages are configured or run.
:func:`describe_entry_stage` reads the resolved :class:`~vllm_omni.config.VllmOmniConfig` and
what every running stage says about itself (its
:class:`~vllm_omni.engine.protocols.StageDescription`) once, and returns an
:class:`EntryStageInfo`; ``Omni`` / ``AsyncOmni`` expose it as ``entry_stage_info``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from vllm_omni.config.call_defaults import CallDefaults, call_defaults
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import DiffusionStageConfig
from vllm_omni.engine.protocols import StageDescription
from vllm_omni.engine.stage_registry import default_stage_params
from vllm_omni.errors import ConfigError
from vllm_omni.lora.request import LoRARequest
from vllm_omni.stages import register_stage_runtimes

OutputKind = Literal["text", "image", "video", "audio", "codec"]


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
            ``"audio"``), as the stages describe themselves.
        stage_is_audio: per stage, in stage-id order, whether it makes audio.
        voices: the voices an audio stage offers (its checkpoint's ``spk_dict.pt``), else empty.
        stages: every stage's own description, in stage-id order.
        entry_final_output: whether the caller receives the entry stage's output.
        stage_defaults: per stage, the params a front end gives it when a request has none of
            its own (a talker's sampling, code2wav's ``AudioParams``), else ``None``.
        stage_call_defaults: per stage, a diffusion stage's steps and guidance for a request that
            sets none (:mod:`vllm_omni.config.call_defaults`), ``None`` for an LLM stage.
        max_adapters_per_request: what the entry stage allows: 1 on an LLM stage (vLLM applies
            one adapter per request), ``max_loras`` on a diffusion one.
        startup_lora_paths: the diffusion entry stage's ``lora_path`` entries, as given
            (any backend); requests may name these paths.
        startup_adapters: the ``LoRARequest`` s the entry stage pre-loads and pins
            (``lora_path`` with the ``peft`` backend); empty otherwise.
        startup_lora_scale: the default scale of ``startup_adapters`` (``lora_scale``).
        accepts_input_image: whether the entry stage takes an input image (its pipeline's call
            takes one: an image-to-image diffusers pipeline; in-tree pipelines here are text-to-image).
        input_image_optional: such an entry stage also runs without the image (Wan2.2 TI2V-5B:
            text-to-video without one); ``False``: it needs one.
        max_model_len: the LLM entry stage's context in tokens, as its engine resolved it.
        media_limits: the most items of each input modality (``"audio"``, ...) one prompt to the
            entry stage may carry (its description's); empty when it takes none.
        audio_sample_rate: the rate (Hz) audio input to the entry stage must have, unless vLLM
            can resample (torchaudio); ``None`` when it takes no audio.
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
    stages: tuple[StageDescription, ...] = ()
    stage_defaults: tuple[Any, ...] = ()
    stage_call_defaults: tuple[CallDefaults | None, ...] = ()
    entry_final_output: bool = False
    startup_lora_paths: tuple[str, ...] = ()
    startup_adapters: tuple[LoRARequest, ...] = ()
    startup_lora_scale: float = 1.0
    accepts_input_image: bool = False
    input_image_optional: bool = False
    max_model_len: int | None = None
    media_limits: Mapping[str, int] = dataclasses.field(default_factory=dict)
    audio_sample_rate: int | None = None
    tokenizer: str | None = None
    trust_remote_code: bool = False

    @property
    def has_llm_stage(self) -> bool:
        return any(self.stage_is_llm)

    @property
    def has_diffusion_stage(self) -> bool:
        return not all(self.stage_is_llm)

    @property
    def call_defaults(self) -> CallDefaults | None:
        """The steps and guidance of a request that sets none, of the first diffusion stage (the one
        an image or video request's fields describe); ``None`` without a diffusion stage."""
        return next((d for d in self.stage_call_defaults if d is not None), None)

    def default_lora_scale(self, lora_int_id: int) -> float:
        """The scale an adapter gets when a request names it without one.

        ``startup_lora_scale`` for a start-up adapter, 1.0 for any other.
        """
        if any(r.lora_int_id == lora_int_id for r in self.startup_adapters):
            return self.startup_lora_scale
        return 1.0


def seeded_stage_default(default: Any, request_params: Any) -> Any:
    """A later stage's own defaults (``stage_defaults``) for a request that gave it no params of its
    own: ``default`` itself, or a copy carrying ``request_params.seed`` when that is set.

    This is the one rule both front ends apply (``Omni`` / ``AsyncOmni`` with one params object, the
    HTTP routes): the request's params describe the entry stage's output (text tokens), and a stage
    with its own defaults (Qwen2.5-Omni's talker samples codec tokens, code2wav takes
    ``AudioParams``) keeps them; only the seed is shared, so a seeded request is reproducible.
    """
    seed = getattr(request_params, "seed", None)
    if default is None or seed is None or not hasattr(default, "seed"):
        return default
    return _with_seed(default, seed)


def seed_unseeded(params: Any, seed: int | None) -> Any:
    """``params`` of one stage of a request whose seed is ``seed``: ``params`` itself when it has no
    ``seed`` field, already sets one, carries its own ``generator``, or ``seed`` is ``None``; else a copy
    carrying ``seed`` (the object passed in is never changed).

    The rule of a seeded request (both front ends): every stage whose params set no seed of their own
    takes the request's seed, so every stage's sampling (an LLM stage's tokens, a diffusion stage's
    latents, a talker's codes) is reproducible, and the same request gives the same output.
    """
    if seed is None or params is None or getattr(params, "seed", 0) is not None:
        return params
    if getattr(params, "generator", None) is not None:
        return params
    return _with_seed(params, seed)


def _with_seed(params: Any, seed: int) -> Any:
    if hasattr(params, "clone"):  # vLLM SamplingParams: an int64, where -1 means unseeded
        copy = params.clone()
        copy.seed = seed % 2**63  # a diffusion seed outside [0, 2**63), e.g. -1 or 2**64 - 1
        return copy
    return dataclasses.replace(params, seed=seed)


def _call_defaults(stage: Any) -> CallDefaults | None:
    """A diffusion stage's :class:`CallDefaults` (from its options and its model), ``None`` for an LLM stage."""
    if stage.is_llm:
        return None
    dcfg = stage.diffusion_config
    # a description without a running stage (whose start checks the model) has the options only
    with contextlib.suppress(ConfigError):
        dcfg = dcfg.with_model(stage.model) if stage.model else dcfg
    return call_defaults(dcfg)


def describe_entry_stage(config: VllmOmniConfig, stages: Sequence[StageDescription]) -> EntryStageInfo:
    """Build the :class:`EntryStageInfo` of a resolved pipeline config whose stages run.

    Args:
        config: the resolved pipeline config (names, options a front end needs).
        stages: the running stages' descriptions, in stage-id order (``Orchestrator.descriptions``).

    Raises:
        ValueError: not one description per stage.
    """
    if len(stages) != len(config.stages):
        raise ValueError(f"{len(stages)} stage descriptions for {len(config.stages)} stages")
    register_stage_runtimes()
    entry, described = config.entry_stage, stages[config.entry_stage.stage_id]
    audio = [d for d in stages if d.output_kind == "audio"]
    common: dict[str, Any] = {  # fields shared by both EntryStageInfo shapes (checked by its constructor)
        "pipeline": config.pipeline.name,
        "model": config.model,
        "label": entry.label,
        "is_llm": entry.is_llm,
        "model_arch": entry.model_arch,
        "stage_is_llm": tuple(s.is_llm for s in config.stages),
        "output_kinds": frozenset(d.output_kind for s, d in zip(config.stages, stages) if s.final_output),
        "stage_is_audio": tuple(d.output_kind == "audio" for d in stages),
        "voices": audio[0].voices if audio else (),
        "stages": tuple(stages),
        "stage_defaults": tuple(default_stage_params(s) for s in config.stages),
        "stage_call_defaults": tuple(_call_defaults(s) for s in config.stages),
        "entry_final_output": bool(entry.final_output),
        "max_adapters_per_request": described.adapters.max_per_request if described.adapters else 1,
        "accepts_input_image": "image" in described.inputs,
        "input_image_optional": "image" in described.inputs and described.image_optional,
    }
    if entry.is_llm:
        options = entry.options
        return EntryStageInfo(
            **common,
            max_model_len=described.max_model_len,
            media_limits=dict(described.media_limits),
            audio_sample_rate=described.audio_sample_rate,
            tokenizer=(options.get("tokenizer") or entry.model) if entry.model else None,
            trust_remote_code=bool(options.get("trust_remote_code", False)),
        )
    assert isinstance(entry, DiffusionStageConfig), entry  # the other entry stages are LLM stages
    dcfg = entry.diffusion_config
    return EntryStageInfo(
        **common,
        startup_lora_paths=tuple(dcfg.startup_lora_paths),
        startup_adapters=described.adapters.startup_adapters if described.adapters else (),
        startup_lora_scale=float(dcfg.lora_scale),
    )
