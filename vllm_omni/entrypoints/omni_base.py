"""Construction and argument handling shared by ``Omni`` and ``AsyncOmni``."""

from __future__ import annotations

import os
from collections.abc import Sequence
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
from vllm_omni.engine.stage_registry import stage_params_type
from vllm_omni.entrypoints.stage_info import EntryStageInfo, describe_entry_stage
from vllm_omni.errors import ConfigError, InvalidRequestError
from vllm_omni.lora.request import RequestAdapter, gather_request_adapters, validate_request_adapters
from vllm_omni.stages import register_stage_runtimes


def build_omni_config(
    model: str | None,
    pipeline: str | None = None,
    deploy_config: Any = None,
    *,
    input_names: InputNames = PYTHON_INPUT_NAMES,
    default_worker_backend: str = "inline",
    **kwargs: Any,
) -> VllmOmniConfig:
    """Resolve the pipeline and every option into a :class:`VllmOmniConfig`.

    The pipeline is, in order: ``pipeline=`` (a registered name), the deploy config's
    ``pipeline:``, or the single-stage default derived from ``model``'s directory.
    ``input_names`` says how errors name the inputs (``CLI_INPUT_NAMES`` for ``serve``);
    ``default_worker_backend`` applies when neither ``worker_backend=`` nor the deploy config
    sets one (``serve`` passes ``"mp"``).
    """
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if model is not None and not isinstance(model, str):
        raise ConfigError(f"model must be a model directory or hub id string, got {type(model).__name__}")
    deploy = load_deploy_config(deploy_config)
    name = pipeline or (deploy.pipeline if deploy is not None else None)
    model = model or (deploy.model if deploy is not None else None)
    if name is None:
        if model is None:
            raise ConfigError("pass model=<path> (or a deploy config naming a pipeline and its models)")
        resolved = pipeline_for_model(model)
    else:
        hf_config = None
        if model is not None and os.path.isdir(model):
            kind, cfg = read_model_dir_config(model)
            hf_config = cfg if kind == "llm" else None
        resolved = resolve_pipeline_config(name, hf_config)
    return VllmOmniConfig.from_pipeline_config(
        resolved,
        cli_overrides=kwargs,
        deploy_config=deploy,
        model=model,
        input_names=input_names,
        default_worker_backend=default_worker_backend,
    )


class OmniBase:
    """Builds the config and the stage runtimes; both entry points share it.

    Args:
        model: model directory (or hub id) of the pipeline.
        pipeline: registered pipeline name; default: derived from ``model``.
        deploy_config: deploy YAML path / dict with a ``stages:`` list.
        **kwargs: options: global engine/diffusion options, ``stage_overrides``
            (dict or JSON keyed by stage id), ``stage_N_<option>`` keys, and ``worker_backend``
            (``"inline"``, the default: stages in this process; ``"mp"``: one worker process
            per stage; ``"ray"``: one Ray actor per stage).
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
        register_stage_runtimes()  # the runtimes of vllm_omni.stages, before the engine looks them up
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
            InvalidRequestError: a per-stage list of the wrong length, or an entry of the wrong type.
        """
        stages = self.config.stages
        per_stage = isinstance(sampling_params, list | tuple)
        if per_stage and len(sampling_params) != len(stages):
            raise InvalidRequestError(
                f"sampling_params has {len(sampling_params)} entries but pipeline "
                f"{self.config.pipeline.name!r} has {len(stages)} stages; pass one per stage or a single object"
            )
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        if not per_stage and sampling_params is not None:
            kinds = {
                stage_params_type(s) or (SamplingParams if s.is_llm else OmniDiffusionSamplingParams)
                for s in stages
            }
            if not isinstance(sampling_params, tuple(kinds)):
                names = " or ".join(sorted(k.__name__ for k in kinds))
                raise InvalidRequestError(
                    f"sampling_params must be {names} (or one per stage) for pipeline "
                    f"{self.config.pipeline.name!r}, got {type(sampling_params).__name__}: {sampling_params!r:.200}"
                )
        out = []
        for i, stage in enumerate(stages):
            params = sampling_params[i] if per_stage else sampling_params
            kind = stage_params_type(stage)
            if kind is None:
                kind = SamplingParams if stage.is_llm else OmniDiffusionSamplingParams
            if isinstance(params, kind):
                out.append(params)
            elif params is None or not per_stage:
                out.append(kind())
            else:
                raise InvalidRequestError(
                    f"sampling_params[{i}] for {stage.label} must be {kind.__name__}, got {type(params).__name__}"
                )
        return out

    def _entry_lora_kwargs(
        self,
        loras: list[Any],
        entry_params: Any,
        lora_scale: Any,
        lora_requests: Any,
        lora_scales: Any,
        *,
        scale_needs_adapter: bool = True,
        adapters: Sequence[RequestAdapter] | None = None,
    ) -> list[dict[str, Any]]:
        """Per-prompt adapter keyword arguments of the entry stage: the request-adapter boundary.

        For a diffusion entry stage every public form (``lora_request`` / ``lora_scale``,
        ``lora_requests`` / ``lora_scales``, the fields of ``entry_params``) becomes one
        ``{"adapters": tuple[RequestAdapter, ...]}`` per prompt, validated once
        (:func:`~vllm_omni.lora.request.gather_request_adapters`) and carried unchanged to the
        diffusion worker. An LLM entry stage takes ``{"lora_request": ...}``.

        Args:
            loras: one ``lora_request`` (or ``None``) per prompt.
            entry_params: the entry stage's sampling params.
            lora_scale: scale of each prompt's ``lora_request``.
            lora_requests / lora_scales: one list for every prompt, or one list per prompt.
            scale_needs_adapter: ``False`` drops ``lora_scale`` for prompts without an adapter
                (``lora_request`` given per prompt) instead of refusing it.
            adapters: the request's adapters already as ``RequestAdapter`` (the HTTP layer's form);
                the other adapter arguments must then be absent.

        Raises:
            InvalidRequestError: these arguments on an LLM entry stage, per-prompt lists of the
                wrong length, or a rule of :func:`~vllm_omni.lora.request.validate_request_adapters`.
        """
        n_prompts = len(loras)
        entry = self.config.entry_stage
        if adapters is not None:
            if (
                lora_scale is not None
                or lora_requests is not None
                or lora_scales is not None
                or any(lr is not None for lr in loras)
            ):
                raise InvalidRequestError(
                    "pass a request's adapters either as adapters or as lora_request / lora_requests, not both"
                )
            return [self._entry_adapter_kwargs(adapters, entry_params)] * n_prompts
        if entry.is_llm:
            if lora_scale is not None or lora_requests is not None or lora_scales is not None:
                raise InvalidRequestError(
                    f"lora_scale / lora_requests / lora_scales apply to diffusion stages; the entry stage is "
                    f"{entry.label}, which takes one adapter per request through lora_request"
                )
            return [{"lora_request": lr} for lr in loras]
        nested = bool(lora_requests) and all(isinstance(x, list | tuple) for x in lora_requests)
        if nested:
            if len(lora_requests) != n_prompts:
                raise InvalidRequestError(
                    f"got {len(lora_requests)} lora_requests lists for {n_prompts} prompts"
                )
            scales = lora_scales if lora_scales is not None else [None] * n_prompts
            if len(scales) != n_prompts or not all(s is None or isinstance(s, list | tuple) for s in scales):
                raise InvalidRequestError(
                    "with one lora_requests list per prompt, pass one lora_scales list per prompt"
                )
            per = list(zip(lora_requests, scales, strict=True))
        else:
            per = [(lora_requests, lora_scales)] * n_prompts
        params_loras = (entry_params.lora_requests, entry_params.lora_scales)
        return [
            {
                "adapters": gather_request_adapters(
                    params_loras,
                    lr,
                    lora_scale if lr is not None or scale_needs_adapter else None,
                    reqs,
                    scales,
                )
            }
            for lr, (reqs, scales) in zip(loras, per, strict=True)
        ]

    def _entry_adapter_kwargs(self, adapters: Sequence[RequestAdapter], entry_params: Any) -> dict[str, Any]:
        """Entry-stage keyword arguments for adapters given as ``RequestAdapter`` (see above).

        Raises:
            InvalidRequestError: a list rule, adapters also in ``entry_params``, or (LLM entry
                stage) more than one adapter or a scale other than 1.0.
        """
        entry = self.config.entry_stage
        adapters = validate_request_adapters(tuple(adapters), field="adapters")
        if entry.is_llm:
            if len(adapters) > 1 or any(a.scale not in (None, 1.0) for a in adapters):
                raise InvalidRequestError(
                    f"{entry.label} is an LLM stage: one adapter per request, applied at scale 1.0 only"
                )
            return {"lora_request": adapters[0].lora if adapters else None}
        if entry_params.lora_requests:
            raise InvalidRequestError(
                "pass a request's adapters either as adapters or as OmniDiffusionSamplingParams.lora_requests"
            )
        return {"adapters": adapters}

    def _per_prompt_loras(
        self, lora_request: Any, n: int, adapters: Sequence[RequestAdapter] | None
    ) -> tuple[list[Any], Sequence[RequestAdapter] | None, list[dict[int, Any]]]:
        """``Omni.generate``'s adapters per prompt: (entry-stage ``lora_request`` per prompt,
        the entry stage's ``adapters``, ``{later stage id: adapter}`` per prompt).

        Raises:
            InvalidRequestError: a ``lora_request`` list whose length is not ``n``, or a rule of
                :meth:`_split_stage_loras` / :meth:`_split_stage_adapters`.
        """
        if isinstance(lora_request, list):
            if len(lora_request) != n:
                raise InvalidRequestError(f"got {len(lora_request)} lora_request entries for {n} prompts")
            split = [self._split_stage_loras(lr) for lr in lora_request]
        else:
            split = [self._split_stage_loras(lora_request)] * n
        adapters, adapter_stage_loras = self._split_stage_adapters(adapters)
        return (
            [entry for entry, _ in split],
            adapters,
            [{**later, **adapter_stage_loras} for _, later in split],
        )

    def _split_stage_loras(self, lora_request: Any) -> tuple[Any, dict[int, Any]]:
        """``lora_request`` as (the entry stage's adapter, ``{later stage id: adapter}``).

        A ``LoRARequest`` (or ``None``) keeps its meaning: the entry stage's adapter. A dict
        keyed by stage id (per-stage request adapters, an opt-in extension) gives each named
        stage its own adapter; the entry stage's key is its id (0). The later stages are checked
        by ``Orchestrator.check_stage_loras`` when the request is submitted.

        Raises:
            InvalidRequestError: a key that is not a stage id of this pipeline.
        """
        if not isinstance(lora_request, dict):
            return lora_request, {}
        entry_id = self.config.entry_stage.stage_id
        later: dict[int, Any] = {}
        for stage_id, lora in lora_request.items():
            if isinstance(stage_id, bool) or not isinstance(stage_id, int):
                raise InvalidRequestError(
                    f"lora_request keys must be stage ids (int), got {stage_id!r:.50}; "
                    f"pipeline {self.config.pipeline.name!r} has stages 0..{len(self.config.stages) - 1}"
                )
            if stage_id != entry_id and lora is not None:
                later[stage_id] = lora
        return lora_request.get(entry_id), later

    def _split_stage_adapters(
        self, adapters: Sequence[RequestAdapter] | None
    ) -> tuple[Sequence[RequestAdapter] | None, dict[int, Any]]:
        """``adapters`` (the HTTP layer's form) as (the entry stage's, ``{later stage id: LoRARequest}``).

        Raises:
            InvalidRequestError: two adapters for one later stage, or one with a scale other than 1.0
                (an LLM stage applies one adapter per request, at scale 1.0).
        """
        if adapters is None:
            return None, {}
        entry_id = self.config.entry_stage.stage_id
        entry = [a for a in adapters if a.stage_id in (None, entry_id)]
        later: dict[int, Any] = {}
        for a in adapters:
            if a.stage_id in (None, entry_id):
                continue
            if a.stage_id in later or a.scale not in (None, 1.0):
                raise InvalidRequestError(
                    f"stage {a.stage_id}: an LLM stage applies one adapter per request, at scale 1.0"
                )
            later[a.stage_id] = a.lora
        return tuple(entry), later

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

    def stage_health(self) -> dict[int, str]:
        """``{stage_id: "starting" | "ready" | "restarting" | "dead"}``: whether each stage serves now
        (an ``mp`` / ``ray`` stage is ``"restarting"`` while its dead worker is replaced)."""
        return self._orchestrator.stage_health()

    def failed_loras(self) -> dict[int, dict[int, str]]:
        """``{stage_id: {lora_int_id: error}}``: adapters a worker restart could not restore (their
        files deleted or unreadable); requests naming one are refused with ``AdapterRestoreError``
        until it is added again. ``{}`` when every adapter was restored."""
        return self._orchestrator.failed_loras()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every stage engine; with ``timeout``, within that many seconds (running requests are abandoned)."""
        orch = getattr(self, "_orchestrator", None)
        if orch is not None:
            orch.shutdown(timeout)
