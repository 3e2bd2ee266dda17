"""Construction and argument handling shared by ``Omni`` and ``AsyncOmni``."""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any

from vllm import SamplingParams

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.overrides import PYTHON_INPUT_NAMES, InputNames, load_deploy_config
from vllm_omni.config.pipeline_registry import (
    pipeline_for_model,
    read_model_dir_config,
    resolve_pipeline_config,
)
from vllm_omni.engine.orchestrator import Orchestrator
from vllm_omni.entrypoints.stage_info import EntryStageInfo, describe_entry_stage


def build_omni_config(
    model: str | None,
    pipeline: str | None = None,
    deploy_config: Any = None,
    *,
    input_names: InputNames = PYTHON_INPUT_NAMES,
    **kwargs: Any,
) -> VllmOmniConfig:
    """Resolve the pipeline and every option into a :class:`VllmOmniConfig`.

    The pipeline is, in order: ``pipeline=`` (a registered name), the deploy config's
    ``pipeline:``, or the single-stage default derived from ``model``'s directory.
    ``input_names`` says how errors name the inputs (``CLI_INPUT_NAMES`` for ``serve``).
    """
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model must be a model directory or hub id string, got {type(model).__name__}")
    deploy = load_deploy_config(deploy_config)
    name = pipeline or (deploy.pipeline if deploy is not None else None)
    model = model or (deploy.model if deploy is not None else None)
    if name is None:
        if model is None:
            raise ValueError("pass model=<path> (or a deploy config naming a pipeline and its models)")
        resolved = pipeline_for_model(model)
    else:
        hf_config = None
        if model is not None and os.path.isdir(model):
            kind, cfg = read_model_dir_config(model)
            hf_config = cfg if kind == "llm" else None
        resolved = resolve_pipeline_config(name, hf_config)
    return VllmOmniConfig.from_pipeline_config(
        resolved, cli_overrides=kwargs, deploy_config=deploy, model=model, input_names=input_names
    )


class OmniBase:
    """Builds the config and the stage runtimes; both entry points share it.

    Args:
        model: model directory (or hub id) of the pipeline.
        pipeline: registered pipeline name; default: derived from ``model``.
        deploy_config: deploy YAML path / dict with a ``stages:`` list.
        **kwargs: options: global engine/diffusion options, ``stage_overrides``
            (dict or JSON keyed by stage id) and ``stage_N_<option>`` keys.
    """

    def __init__(
        self, model: str | None = None, *, pipeline: str | None = None, deploy_config: Any = None, **kwargs
    ):
        self._start(build_omni_config(model, pipeline, deploy_config, **kwargs))

    @classmethod
    def from_config(cls, config: VllmOmniConfig):
        """Start the engines of an already resolved config (from :func:`build_omni_config`).

        ``vllm serve`` resolves the config once, checks it (``--dry-run`` prints it) and
        starts exactly that config.
        """
        omni = cls.__new__(cls)
        omni._start(config)
        return omni

    def _start(self, config: VllmOmniConfig) -> None:
        self.config = config
        self._orchestrator = Orchestrator(config)

    @property
    def stage_configs(self):
        return self.config.stages

    @cached_property
    def entry_stage_info(self) -> EntryStageInfo:
        """What front ends need to know about this pipeline (output kinds, adapters per
        request, start-up adapters and their default scale, ...); computed once."""
        return describe_entry_stage(self.config)

    def _stage_params(self, sampling_params: Any) -> list[Any]:
        """One params object per stage.

        ``sampling_params`` may be ``None`` (defaults everywhere), one object (applied to
        every stage of its kind: ``SamplingParams`` for LLM stages,
        ``OmniDiffusionSamplingParams`` for diffusion stages), or a list with one entry per
        stage (``None`` entries take the default).

        Raises:
            ValueError: a per-stage list of the wrong length, or an entry of the wrong type.
        """
        stages = self.config.stages
        per_stage = isinstance(sampling_params, list | tuple)
        if per_stage and len(sampling_params) != len(stages):
            raise ValueError(
                f"sampling_params has {len(sampling_params)} entries but pipeline "
                f"{self.config.pipeline.name!r} has {len(stages)} stages; pass one per stage or a single object"
            )
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        if not per_stage and sampling_params is not None:
            kinds = {SamplingParams if s.is_llm else OmniDiffusionSamplingParams for s in stages}
            if not isinstance(sampling_params, tuple(kinds)):
                names = " or ".join(sorted(k.__name__ for k in kinds))
                raise ValueError(
                    f"sampling_params must be {names} (or one per stage) for pipeline "
                    f"{self.config.pipeline.name!r}, got {type(sampling_params).__name__}: {sampling_params!r:.200}"
                )
        out = []
        for i, stage in enumerate(stages):
            params = sampling_params[i] if per_stage else sampling_params
            if stage.is_llm:
                kind = SamplingParams
            else:
                kind = OmniDiffusionSamplingParams
            if isinstance(params, kind):
                out.append(params)
            elif params is None or not per_stage:
                out.append(kind())
            else:
                raise ValueError(
                    f"sampling_params[{i}] for {stage.label} must be {kind.__name__}, got {type(params).__name__}"
                )
        return out

    def _entry_lora_kwargs(
        self, n_prompts: int, lora_scale: Any, lora_requests: Any, lora_scales: Any
    ) -> list[dict[str, Any]]:
        """Per-prompt diffusion LoRA keyword arguments for the entry stage.

        ``lora_requests`` is a list of ``LoRARequest`` (the same set for every prompt) or a
        list with one such list per prompt; ``lora_scales`` follows the same nesting.

        Raises:
            ValueError: these arguments on an LLM entry stage, or per-prompt lists of the
                wrong length.
        """
        if lora_scale is None and lora_requests is None and lora_scales is None:
            return [{} for _ in range(n_prompts)]
        entry = self.config.entry_stage
        if entry.is_llm:
            raise ValueError(
                f"lora_scale / lora_requests / lora_scales apply to diffusion stages; the entry stage is "
                f"{entry.label}, which takes one adapter per request through lora_request"
            )
        nested = bool(lora_requests) and all(isinstance(x, list | tuple) for x in lora_requests)
        if nested:
            if len(lora_requests) != n_prompts:
                raise ValueError(f"got {len(lora_requests)} lora_requests lists for {n_prompts} prompts")
            scales = lora_scales if lora_scales is not None else [None] * n_prompts
            if len(scales) != n_prompts or not all(s is None or isinstance(s, list | tuple) for s in scales):
                raise ValueError(
                    "with one lora_requests list per prompt, pass one lora_scales list per prompt"
                )
            per = [(list(r), None if s is None else list(s)) for r, s in zip(lora_requests, scales)]
        else:
            per = [(lora_requests, lora_scales)] * n_prompts
        out = []
        for reqs, scales in per:
            kw: dict[str, Any] = {}
            if lora_scale is not None:
                kw["lora_scale"] = lora_scale
            if reqs is not None:
                kw["lora_requests"] = reqs
            if scales is not None:
                kw["lora_scales"] = scales
            out.append(kw)
        return out

    # ---------------------------------------------------------------- LoRA management
    def _add_lora(self, lora_request, stage_id: int | None = None) -> bool:
        return all(self._orchestrator.lora_call("add_lora", lora_request, stage_id=stage_id).values())

    def _remove_lora(self, lora_int_id: int, stage_id: int | None = None) -> bool:
        return any(self._orchestrator.lora_call("remove_lora", lora_int_id, stage_id=stage_id).values())

    def _list_loras(self, stage_id: int | None = None) -> set[int]:
        out: set[int] = set()
        for ids in self._orchestrator.lora_call("list_loras", stage_id=stage_id).values():
            out |= set(ids)
        return out

    def _pin_lora(self, lora_int_id: int, stage_id: int | None = None) -> bool:
        return all(self._orchestrator.lora_call("pin_lora", lora_int_id, stage_id=stage_id).values())

    def shutdown(self) -> None:
        """Stop every stage engine."""
        orch = getattr(self, "_orchestrator", None)
        if orch is not None:
            orch.shutdown()
