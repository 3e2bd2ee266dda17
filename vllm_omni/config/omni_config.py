"""``VllmOmniConfig``: every input path resolved into one typed config per stage.

Inputs, from lowest to highest precedence:

1. the registered pipeline's stage defaults;
2. the deploy YAML (``stages:`` entries, ``engine_extras`` merged in);
3. explicit global options (``Omni(**kwargs)`` / serve CLI flags);
4. explicit stage-scoped options: ``stage_overrides`` (dict or JSON), then ``stage_N_<key>``.

Rules (see docs/design/lora.md):

- On a single-stage pipeline a global option applies to that stage.
- On a multi-stage pipeline a global option applies to every stage that owns it, except
  vLLM LoRA options, which are rejected (they would enable LoRA on downstream LLM stages
  that never receive a request's adapter). ``max_cpu_loras`` and ``max_loras`` keep their
  diffusion meaning when the pipeline has a diffusion stage and then size only the
  diffusion LoRA cache.
- Every key must be owned by the stage it lands on; unknown keys fail with the stage id,
  stage type and a spelling suggestion.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vllm_omni.config.fields import (
    DIFFUSION_LORA_FIELDS,
    LORA_FIELD_ALIASES,
    STAGE_META_KEYS,
    lora_engine_arg_names,
    owned_keys,
)
from vllm_omni.config.overrides import (
    PYTHON_INPUT_NAMES,
    DeployConfig,
    InputNames,
    load_deploy_config,
    parse_stage_overrides,
    split_stage_scoped_keys,
    suggest,
)
from vllm_omni.config.pipeline_registry import PipelineConfig
from vllm_omni.config.stage_config import BaseVllmOmniStageConfig, make_stage_config
from vllm_omni.errors import ConfigError

#: The values of the pipeline-wide ``worker_backend`` option (see docs/user_guide/deployment.md).
WORKER_BACKENDS = ("inline", "mp", "ray")

# Keys that carry stage-scoped input rather than an option.
_ROUTING_KEYS = ("stage_overrides", "deploy_config")

# Both LoRA paths use these names; next to a diffusion stage a global value means the diffusion one.
_SHARED_LORA_NAMES = frozenset({"max_cpu_loras", "max_loras"})


def _vllm_lora_keys() -> frozenset[str]:
    return lora_engine_arg_names() | frozenset(LORA_FIELD_ALIASES)


def _where(origins: dict[str, str], key: str, label: str) -> str:
    """``<input that set key>, stage N (type)``: where a stage's option came from."""
    source = origins.get(key)
    return f"{source}, {label[0].lower()}{label[1:]}" if source else label


def _check_meta_types(label: str, meta: dict[str, Any], origins: dict[str, str]) -> None:
    """Stage-level keys must have their own types (``bool("no")`` would be ``True``)."""
    for key in ("model", "model_arch"):
        value = meta.get(key)
        if value is not None and not isinstance(value, str | os.PathLike):
            raise ConfigError(
                f"{_where(origins, key, label)}: {key} must be a string, got {type(value).__name__}: {value!r}",
                options=(key,),
            )
    if "model" in meta and meta["model"] is not None:
        meta["model"] = os.fspath(meta["model"])
    if "final_output" in meta and not isinstance(meta["final_output"], bool):
        raise ConfigError(
            f"{_where(origins, 'final_output', label)}: final_output must be true or false, "
            f"got {meta['final_output']!r}",
            options=("final_output",),
        )
    resources = meta.get("ray_resources")
    if resources is not None and not (
        isinstance(resources, dict)
        and all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
            for k, v in resources.items()
        )
    ):
        raise ConfigError(
            f"{_where(origins, 'ray_resources', label)}: ray_resources must map Ray resource names to "
            f'amounts >= 0, e.g. {{"node_a": 1}}, got {resources!r}',
            options=("ray_resources",),
        )
    if "engine_input_source" in meta:
        source = meta["engine_input_source"]
        if not isinstance(source, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in source
        ):
            raise ConfigError(
                f"{_where(origins, 'engine_input_source', label)}: engine_input_source must be a list of "
                f"stage ids (integers >= 0), got {source!r}",
                options=("engine_input_source",),
            )


@dataclass
class VllmOmniConfig:
    """The resolved configuration of a pipeline: one typed stage config per stage.

    Attributes:
        pipeline: the topology that was resolved.
        stages: stage configs in stage-id order.
        model: the default model path of the pipeline (stages may override it).
        worker_backend: where stage runtimes run: ``"inline"`` (this process), ``"mp"`` (one
            worker process per stage) or ``"ray"`` (one Ray actor per stage).
        ray_address: the Ray cluster of ``worker_backend="ray"`` (default: ``RAY_ADDRESS``,
            else a local cluster started for the pipeline).
    """

    pipeline: PipelineConfig
    stages: list[BaseVllmOmniStageConfig]
    model: str | None = None
    worker_backend: str = "inline"
    ray_address: str | None = None

    def stage_by_id(self, stage_id: int) -> BaseVllmOmniStageConfig:
        """The config of stage ``stage_id``.

        Raises:
            ConfigError: no such stage (the message lists the valid ids).
        """
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        raise ConfigError(
            f"pipeline {self.pipeline.name!r} has no stage {stage_id}; stages: {self.stage_ids}"
        )

    @property
    def stage_ids(self) -> list[int]:
        return [s.stage_id for s in self.stages]

    @property
    def entry_stage(self) -> BaseVllmOmniStageConfig:
        """The stage that receives the user's request (stage 0)."""
        return self.stages[0]

    @classmethod
    def from_pipeline_config(
        cls,
        pipeline: PipelineConfig,
        cli_overrides: dict[str, Any] | None = None,
        deploy_config: str | os.PathLike | dict | DeployConfig | None = None,
        model: str | None = None,
        input_names: InputNames = PYTHON_INPUT_NAMES,
        default_worker_backend: str = "inline",
    ) -> VllmOmniConfig:
        """Resolve every input path into typed stage configs.

        Args:
            pipeline: from :func:`~vllm_omni.config.pipeline_registry.resolve_pipeline_config`.
            cli_overrides: explicit options: global ones, ``stage_N_<key>`` keys and a
                ``stage_overrides`` entry (dict or JSON string keyed by stage id); a
                ``deploy_config`` entry is used when the argument is not given.
            deploy_config: deploy YAML path, dict or :class:`DeployConfig`.
            model: default model path for stages that name none.
            input_names: how messages name the inputs (``CLI_INPUT_NAMES`` for the command line).
            default_worker_backend: ``worker_backend`` when neither ``cli_overrides`` nor the
                deploy config sets it (``Omni``: ``"inline"``; ``serve``: ``"mp"``).

        Raises:
            ConfigError: malformed overrides, unknown stage ids, unowned/misspelled keys,
                global vLLM LoRA options on a multi-stage pipeline, ``enable_lora`` on a
                diffusion stage, or an invalid option value (vLLM's validation). Messages name
                the input each offending value came from and the stage.
        """
        explicit = dict(cli_overrides or {})
        stage_overrides = parse_stage_overrides(
            explicit.pop("stage_overrides", None), input_names.stage_overrides
        )
        deploy_source = explicit.pop("deploy_config", None)
        deploy = load_deploy_config(deploy_config if deploy_config is not None else deploy_source)
        worker_backend = cls._worker_backend(explicit, deploy, default_worker_backend, input_names)
        ray_address = cls._ray_address(explicit, deploy, input_names)
        global_opts, stage_keys = split_stage_scoped_keys(explicit)
        if "model" in global_opts:
            model = model or global_opts.pop("model")
            global_opts.pop("model", None)
        if deploy is not None and model is None:
            model = deploy.model

        n = pipeline.num_stages
        deploy_opts = deploy.stage_options() if deploy is not None else {}
        for source, per_stage in (
            (deploy.source_name if deploy is not None else "deploy config", deploy_opts),
            (input_names.stage_overrides, stage_overrides),
            ("stage_N_<key> options", stage_keys),
        ):
            bad = sorted(i for i in per_stage if i >= n)
            if bad:
                raise ConfigError(
                    f"{source}: no stage(s) {bad} in pipeline {pipeline.name!r}, whose stages are {list(range(n))}"
                )

        routed_global = cls._route_global_options(pipeline, global_opts, input_names)
        stages = []
        for stage_id, spec in enumerate(pipeline.stages):
            merged: dict[str, Any] = {}
            origins: dict[str, str] = {}  # option -> the input that set it (the last layer wins)
            deploy_name = deploy.stage_source(stage_id) if deploy is not None else ""
            for layer, name_of in (
                (spec.defaults, lambda key: f"pipeline {pipeline.name!r} defaults"),
                (deploy_opts.get(stage_id, {}), lambda key, name=deploy_name: name),
                (routed_global.get(stage_id, {}), input_names.global_option),
                (stage_overrides.get(stage_id, {}), lambda key: input_names.stage_overrides),
                (stage_keys.get(stage_id, {}), lambda key, i=stage_id: f"stage_{i}_{key}"),
            ):
                for key, value in layer.items():
                    name = key if spec.stage_type == "diffusion" else LORA_FIELD_ALIASES.get(key, key)
                    merged[name] = value
                    origins[name] = name_of(key)
            stages.append(cls._build_stage(pipeline, stage_id, merged, model, origins))
        config = cls(pipeline=pipeline, stages=stages, model=model, worker_backend=worker_backend)
        config.ray_address = ray_address
        return config

    @staticmethod
    def _worker_backend(
        explicit: dict[str, Any], deploy: DeployConfig | None, default: str, input_names: InputNames
    ) -> str:
        """The pipeline-wide ``worker_backend`` (popped from ``explicit``): explicit, then deploy YAML, then ``default``.

        Raises:
            ConfigError: not one of ``inline`` / ``mp`` / ``ray`` (naming the input).
        """
        value = explicit.pop("worker_backend", None)
        source = input_names.global_option("worker_backend")
        if value is None and deploy is not None and deploy.worker_backend is not None:
            value, source = deploy.worker_backend, f"{deploy.source_name}, worker_backend"
        if value is None:
            value = default
        if value not in WORKER_BACKENDS:
            raise ConfigError(
                f"{source}: unknown worker backend {value!r}; choose one of {list(WORKER_BACKENDS)}",
                options=("worker_backend",),
            )
        return value

    @staticmethod
    def _ray_address(
        explicit: dict[str, Any], deploy: DeployConfig | None, input_names: InputNames
    ) -> str | None:
        """The pipeline-wide ``ray_address`` (popped from ``explicit``): explicit, then deploy YAML.

        Raises:
            ConfigError: not a string (naming the input).
        """
        value = explicit.pop("ray_address", None)
        if value is None and deploy is not None:
            value = deploy.ray_address
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"{input_names.global_option('ray_address')}: ray_address must be a string such as "
                f"'ray://head:10001' or 'auto', got {value!r}",
                options=("ray_address",),
            )
        return value

    @staticmethod
    def _route_global_options(
        pipeline: PipelineConfig, global_opts: dict[str, Any], input_names: InputNames = PYTHON_INPUT_NAMES
    ) -> dict[int, dict[str, Any]]:
        """Decide which stages each global option applies to (see the module docstring)."""
        routed: dict[int, dict[str, Any]] = {}
        llm_ids = pipeline.stage_ids(kind="llm")
        diffusion_ids = pipeline.stage_ids(kind="diffusion")
        rejected_lora = []
        for key, value in global_opts.items():
            if key in _ROUTING_KEYS:
                continue
            if not pipeline.is_multi_stage:
                routed.setdefault(0, {})[key] = value
                continue
            if key in _SHARED_LORA_NAMES and diffusion_ids:
                for i in diffusion_ids:
                    routed.setdefault(i, {})[key] = value
                continue
            if key in _vllm_lora_keys():
                rejected_lora.append(key)
                continue
            targets = [
                i
                for i, spec in enumerate(pipeline.stages)
                if key in owned_keys(spec.stage_type) or key in STAGE_META_KEYS - {"stage_type"}
            ]
            if not targets:
                allowed = set().union(*(owned_keys(s.stage_type) for s in pipeline.stages))
                kinds = sorted({s.stage_type for s in pipeline.stages})
                raise ConfigError(
                    f"{input_names.global_option(key)}: option {key!r} is not accepted by any stage of "
                    f"pipeline {pipeline.name!r} (stage types {kinds}){suggest(key, allowed)}",
                    options=(key,),
                )
            for i in targets:
                routed.setdefault(i, {})[key] = value
        if rejected_lora:
            example = "{" + ", ".join(f'"{k}": ...' for k in sorted(rejected_lora)) + "}"
            raise ConfigError(
                f"{', '.join(input_names.global_option(k) for k in sorted(rejected_lora))}: "
                f"global vLLM LoRA option(s) {sorted(rejected_lora)} are ambiguous on multi-stage pipeline "
                f"{pipeline.name!r}: its LLM stages are {llm_ids}, and a request's adapter only reaches the "
                f"entry stage. Scope them to a stage instead, e.g. "
                f'stage_overrides={{"{llm_ids[0] if llm_ids else 0}": {example}}} in Python, '
                f"--stage-overrides '{{\"{llm_ids[0] if llm_ids else 0}\": {example}}}' on the command line, "
                f"stage_{llm_ids[0] if llm_ids else 0}_<option>=..., or the stage's deploy YAML entry.",
                options=sorted(rejected_lora),
            )
        return routed

    @staticmethod
    def _build_stage(
        pipeline: PipelineConfig,
        stage_id: int,
        merged: dict[str, Any],
        default_model: str | None,
        origins: dict[str, str] | None = None,
    ) -> BaseVllmOmniStageConfig:
        spec = pipeline.stages[stage_id]
        label = f"Stage {stage_id} ({spec.stage_type})"
        origins = origins or {}
        if "stage_type" in merged and merged.pop("stage_type") != spec.stage_type:
            raise ConfigError(
                f"{_where(origins, 'stage_type', label)}: stage_type cannot be changed from "
                f"{spec.stage_type!r} by options",
                options=("stage_type",),
            )
        meta = {k: merged.pop(k) for k in list(merged) if k in STAGE_META_KEYS}
        allowed = owned_keys(spec.stage_type)
        if spec.stage_type == "diffusion":
            vllm_lora = sorted(k for k in merged if k in _vllm_lora_keys() and k not in DIFFUSION_LORA_FIELDS)
            if vllm_lora:
                raise ConfigError(
                    f"{'; '.join(_where(origins, k, label) for k in vllm_lora)}: {label} does not accept vLLM LoRA option(s) {vllm_lora}: diffusion stages use the "
                    f"diffusion LoRA manager; set {' / '.join(sorted(DIFFUSION_LORA_FIELDS))} on this stage instead",
                    options=vllm_lora,
                )
        unknown = sorted(k for k in merged if k not in allowed)
        if unknown:
            hints = "; ".join(
                f"{_where(origins, k, label)}: unknown option {k!r}{suggest(k, set(allowed) | STAGE_META_KEYS)}"
                for k in unknown
            )
            raise ConfigError(f"{hints} (pipeline {pipeline.name!r})", options=unknown)
        _check_meta_types(label, meta, origins)
        source = meta.get("engine_input_source", list(spec.engine_input_source))
        model = meta.get("model") or default_model
        if model is not None and spec.model_subfolder and not meta.get("model"):
            model = os.path.join(model, spec.model_subfolder)
        return make_stage_config(
            stage_id=stage_id,
            stage_type=spec.stage_type,
            model=model,
            model_arch=meta.get("model_arch", spec.model_arch),
            engine_input_source=list(source),
            final_output=bool(meta.get("final_output", spec.final_output)),
            ray_resources=dict(meta.get("ray_resources") or {}),
            options=merged,
            origins=origins,
            devices=meta.get("devices"),
            replicas=meta.get("replicas", 1),
            **{k: meta[k] for k in ("max_restarts", "restart_backoff_s") if k in meta},
        )
