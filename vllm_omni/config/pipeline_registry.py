"""Registry of pipeline topologies (ordered stages with their kinds and model classes).

A *pipeline* is what ``VllmOmniConfig.from_pipeline_config`` resolves options against:
which stages exist, what kind each one is, which model class it needs and which
stage outputs feed it. Registered names follow the public project's: ``qwen3_tts``,
``qwen2_5_omni``, ``qwen2_5_omni_thinker_only``, ``bagel``, ``wan2_2_ti2v``; plus
pipelines that run on any causal LM / diffusers directory (``llm_chain``,
``llm_to_diffusion``) and the single-stage defaults derived from a model directory.

Registering a topology does not make its model classes available. Run end to end (tested on
tiny checkpoints; ``wan2_2_ti2v`` through its class): ``qwen2_5_omni`` (thinker and talker on
vLLM, code2wav on transformers' Token2Wav: :mod:`vllm_omni.stages.qwen2_5_omni`),
``qwen2_5_omni_thinker_only`` and ``qwen3_omni_thinker_only`` (vLLM's Qwen2.5-Omni / Qwen3-Omni MoE
thinkers, registered by :mod:`vllm_omni.models`), ``qwen3_omni`` (the MoE thinker on vLLM, talker and
code2wav on transformers: :mod:`vllm_omni.stages.qwen3_omni`),
``wan2_2_ti2v``, ``llm_chain``, ``llm_to_diffusion`` and the single-stage defaults. ``qwen3_tts``
and ``bagel`` name classes that neither this package nor stock vLLM / diffusers implement yet.
They resolve (options, overrides, ``--dry-run``), and starting one fails before any engine is
built with a ``StageEngineError`` naming the stage and the missing class (``Orchestrator`` checks
every stage first).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from huggingface_hub import snapshot_download

from vllm_omni.errors import ConfigError

DIFFUSION_INDEX = "model_index.json"
HF_CONFIG = "config.json"


@dataclass(frozen=True)
class StageSpec:
    """One stage of a registered pipeline.

    Attributes:
        stage_type: ``llm_ar``, ``llm_generation`` or ``diffusion``.
        model_arch: model class the stage needs; ``None`` means "whatever the model
            directory declares" (HF ``architectures[0]`` / diffusers ``_class_name``).
        engine_input_source: stages whose outputs feed this one (empty: the user prompt).
        input_processor: how a downstream stage builds its prompt from upstream output:
            ``"prompt"`` (the user's), ``"previous_text"`` (upstream generated text), or a
            tensor hand-off registered in :mod:`vllm_omni.engine.stage_registry`
            (``"thinker2talker"``, ``"talker2code2wav"``).
        final_output: whether the caller receives this stage's output.
        defaults: option defaults of this stage (lowest precedence).
        model_subfolder: sub-directory of the pipeline's model holding this stage's weights.
    """

    stage_type: str
    model_arch: str | None = None
    engine_input_source: tuple[int, ...] = ()
    input_processor: str = "prompt"
    final_output: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)
    model_subfolder: str | None = None


@dataclass(frozen=True)
class PipelineConfig:
    """A resolved pipeline topology: a name and its ordered stages (stage id = index)."""

    name: str
    stages: tuple[StageSpec, ...]
    description: str = ""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def is_multi_stage(self) -> bool:
        return len(self.stages) > 1

    def stage_ids(self, *, kind: str | None = None) -> list[int]:
        """Stage ids, optionally only ``"llm"`` or ``"diffusion"`` ones."""
        out = []
        for i, spec in enumerate(self.stages):
            is_diff = spec.stage_type == "diffusion"
            if kind is None or (kind == "diffusion") == is_diff:
                out.append(i)
        return out


def _ar(arch=None, **kw) -> StageSpec:
    return StageSpec("llm_ar", arch, **kw)


def _omni(name: str, thinker: str, talker: str, code2wav: str, description: str) -> PipelineConfig:
    """An Omni topology: thinker (text out) -> talker (``thinker2talker``) -> code2wav (audio out)."""
    return PipelineConfig(
        name,
        (
            _ar(thinker, final_output=True),
            _ar(talker, engine_input_source=(0,), input_processor="thinker2talker"),
            StageSpec("llm_generation", code2wav, (1,), "talker2code2wav", final_output=True),
        ),
        description,
    )


_REGISTRY: dict[str, PipelineConfig] = {}


def register_pipeline(pipeline: PipelineConfig, *, overwrite: bool = False) -> None:
    """Add a pipeline topology to the registry.

    Raises:
        ConfigError: if the name is taken (unless ``overwrite``) or the topology is malformed.
    """
    if pipeline.name in _REGISTRY and not overwrite:
        raise ConfigError(f"pipeline {pipeline.name!r} is already registered")
    if not pipeline.stages:
        raise ConfigError(f"pipeline {pipeline.name!r} has no stages")
    for i, spec in enumerate(pipeline.stages):
        if any(src >= i or src < 0 for src in spec.engine_input_source):
            raise ConfigError(f"pipeline {pipeline.name!r} stage {i}: inputs must come from earlier stages")
    if not any(s.final_output for s in pipeline.stages):
        raise ConfigError(f"pipeline {pipeline.name!r}: no stage is marked final_output")
    _REGISTRY[pipeline.name] = pipeline


for _p in (
    PipelineConfig(
        "qwen3_tts",
        (
            _ar("Qwen3TTSTalkerForConditionalGeneration"),
            StageSpec("llm_generation", "Qwen3TTSCode2Wav", (0,), "previous_tokens", final_output=True),
        ),
        "Qwen3-TTS: talker (AR) -> code2wav (generation)",
    ),
    _omni(
        "qwen2_5_omni",
        "OmniQwen2_5OmniThinkerForConditionalGeneration",
        "OmniQwen2_5OmniTalkerForConditionalGeneration",
        "OmniQwen2_5OmniToken2WavModel",
        "Qwen2.5-Omni: thinker -> talker -> code2wav",
    ),
    PipelineConfig(
        "qwen2_5_omni_thinker_only",
        (_ar("OmniQwen2_5OmniThinkerForConditionalGeneration", final_output=True),),
        "Qwen2.5-Omni thinker alone (text out)",
    ),
    _omni(
        "qwen3_omni",
        "OmniQwen3OmniMoeThinkerForConditionalGeneration",
        "OmniQwen3OmniMoeTalkerForConditionalGeneration",
        "OmniQwen3OmniMoeCode2Wav",
        "Qwen3-Omni: MoE thinker -> talker (with code predictor) -> code2wav",
    ),
    PipelineConfig(
        "qwen3_omni_thinker_only",
        (_ar("OmniQwen3OmniMoeThinkerForConditionalGeneration", final_output=True),),
        "Qwen3-Omni MoE thinker alone (text out)",
    ),
    PipelineConfig(
        "bagel",
        (
            _ar("OmniBagelForConditionalGeneration"),
            StageSpec("diffusion", "BagelPipeline", (0,), "bagel_ar2dit", final_output=True),
        ),
        "BAGEL: AR understanding stage -> DiT generation stage",
    ),
    PipelineConfig(
        "wan2_2_ti2v",
        (StageSpec("diffusion", "WanPipeline", final_output=True),),
        "Wan2.2 text/image-to-video (single diffusion stage)",
    ),
    PipelineConfig(
        "llm_chain",
        (_ar(), _ar(engine_input_source=(0,), input_processor="previous_text", final_output=True)),
        "Two causal LMs in a chain: stage 1's prompt is stage 0's generated text",
    ),
    PipelineConfig(
        "llm_to_diffusion",
        (
            _ar(),
            StageSpec("diffusion", None, (0,), "previous_text", final_output=True),
        ),
        "A causal LM (e.g. a prompt rewriter) whose text becomes a diffusion stage's prompt",
    ),
):
    register_pipeline(_p)


#: ``architectures[0]`` of a checkpoint -> (pipeline with audio output, pipeline without): the
#: pipeline a model directory gets when no pipeline is named (``enable_audio_output`` chooses).
PIPELINES_BY_ARCHITECTURE: dict[str, tuple[str, str]] = {
    "Qwen2_5OmniForConditionalGeneration": ("qwen2_5_omni", "qwen2_5_omni_thinker_only"),
    "Qwen3OmniMoeForConditionalGeneration": ("qwen3_omni", "qwen3_omni_thinker_only"),
}


def registered_pipelines() -> list[str]:
    """Names of every registered pipeline."""
    return sorted(_REGISTRY)


def _hf_architecture(hf_config: Any) -> str | None:
    if hf_config is None:
        return None
    archs = (
        hf_config.get("architectures")
        if isinstance(hf_config, dict)
        else getattr(hf_config, "architectures", None)
    )
    return archs[0] if archs else None


def resolve_pipeline_config(name: str, hf_config: Any = None) -> PipelineConfig:
    """Look up a registered pipeline, filling open model classes from ``hf_config``.

    Args:
        name: registered pipeline name (see :func:`registered_pipelines`), or
            ``"default_llm"`` / ``"default_diffusion"`` for a single-stage pipeline.
        hf_config: the model's HF config (``PretrainedConfig`` or dict) or ``None``.
            Its ``architectures[0]`` fills LLM stages declared with ``model_arch=None``.

    Raises:
        ConfigError: unknown name (the message lists the registered ones).
    """
    if name == "default_llm":
        return PipelineConfig(
            name, (_ar(_hf_architecture(hf_config), final_output=True),), "single LLM stage"
        )
    if name == "default_diffusion":
        cls_name = hf_config.get("_class_name") if isinstance(hf_config, dict) else None
        return PipelineConfig(
            name, (StageSpec("diffusion", cls_name, final_output=True),), "single diffusion stage"
        )
    if name not in _REGISTRY:
        raise ConfigError(
            f"unknown pipeline {name!r}; registered pipelines: {', '.join(registered_pipelines())}"
        )
    pipeline = _REGISTRY[name]
    arch = _hf_architecture(hf_config)
    if arch is None:
        return pipeline
    stages = tuple(
        replace(s, model_arch=arch) if s.model_arch is None and s.stage_type != "diffusion" else s
        for s in pipeline.stages
    )
    return replace(pipeline, stages=stages)


def read_model_dir_config(model: str) -> tuple[str, dict]:
    """Identify a local model directory: ``("diffusion", model_index)`` or ``("llm", config)``.

    Raises:
        ConfigError: when the directory holds neither ``model_index.json`` nor ``config.json``.
    """
    for kind, name in (("diffusion", DIFFUSION_INDEX), ("llm", HF_CONFIG)):
        path = os.path.join(model, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise ConfigError(f"model directory {model!r}: cannot read {name}: {exc}") from exc
            if not isinstance(data, dict):
                raise ConfigError(f"model directory {model!r}: {name} must hold a JSON object")
            return kind, data
    raise ConfigError(
        f"model directory {model!r} has neither {DIFFUSION_INDEX} (diffusers pipeline) nor {HF_CONFIG} "
        "(transformers model); pass pipeline=<name> to choose a registered pipeline"
    )


def pipeline_for_model(model: str) -> PipelineConfig:
    """Default pipeline for a model directory (or hub id of a cached model).

    ``config.json`` whose ``architectures[0]`` is in :data:`PIPELINES_BY_ARCHITECTURE` -> that
    registered multi-stage pipeline (a Qwen2.5-Omni or Qwen3-Omni checkpoint; its
    ``enable_audio_output``, default true, chooses the audio or the text-only one); other
    ``config.json`` with ``architectures`` -> one ``llm_ar`` stage of that class;
    ``model_index.json`` -> one diffusion stage of its ``_class_name``.
    """
    path = model
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(f"model must be a model directory or hub id string, got {model!r}")
    if not os.path.isdir(path):
        looks_local = os.path.isabs(model) or model.startswith((".", "~")) or os.path.exists(model)
        if os.path.exists(model):
            raise ConfigError(f"model {model!r} is a file, not a model directory")
        if looks_local or model.count("/") > 1:
            raise ConfigError(f"model directory {model!r} does not exist")

        try:
            path = snapshot_download(model, allow_patterns=[HF_CONFIG, DIFFUSION_INDEX])
        except Exception as exc:  # offline, unknown repo, bad id
            raise ConfigError(
                f"model {model!r} is not a local directory and could not be fetched from the hub: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    kind, cfg = read_model_dir_config(path)
    architecture = _hf_architecture(cfg) if kind == "llm" else None
    if architecture is not None and architecture in PIPELINES_BY_ARCHITECTURE:
        with_audio, text_only = PIPELINES_BY_ARCHITECTURE[architecture]
        return resolve_pipeline_config(with_audio if cfg.get("enable_audio_output", True) else text_only, cfg)
    return resolve_pipeline_config("default_diffusion" if kind == "diffusion" else "default_llm", cfg)
