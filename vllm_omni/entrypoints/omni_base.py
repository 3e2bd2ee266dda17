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
from vllm_omni.entrypoints.request_adapters import request_adapters
from vllm_omni.entrypoints.stage_info import (
    EntryStageInfo,
    describe_entry_stage,
    seed_unseeded,
    seeded_stage_default,
)
from vllm_omni.errors import ConfigError, InvalidAdapterError, InvalidRequestError, restate
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.registry import AdapterRegistry
from vllm_omni.lora.request import RequestAdapters, startup_lora_request
from vllm_omni.stages import register_stage_runtimes
from vllm_omni.stats import StageStats


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


#: Hand-offs (a stage's ``input_processor``) that pass on the entry stage's output without its
#: prompt's multimodal data: ``thinker2talker``. A stage fed by one speaks a reply to a prompt with
#: audio / image / video only when its description takes ``"media_payload"`` (the Qwen2.5-Omni talker:
#: the thinker's hidden states of those positions come with the hand-off; the Qwen3-Omni talker reads
#: token embeddings only).
TEXT_ONLY_HANDOFFS = frozenset({"thinker2talker"})


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
        #: every adapter of this engine and its state per stage (:mod:`vllm_omni.lora.registry`)
        self.adapter_registry = AdapterRegistry(
            self._orchestrator.lora_call,
            config.entry_stage.stage_id,
            {stage.stage_id: stage.label for stage in config.stages},
            check=self._check_stage_adapter,
            denoisers=self._stage_denoisers,
        )
        # a restarted worker restores what the registry says its stage holds, and reports what it lost
        self._orchestrator.attach_adapter_owner(
            self.adapter_registry.expected_on,
            lambda stage_id, failed, replica: self.adapter_registry.note_restart(stage_id, failed, replica),
        )
        for stage in config.stages:  # the adapters diffusion stages pre-loaded (lora_path, peft backend)
            dcfg = getattr(stage, "diffusion_config", None) if not stage.is_llm else None
            if dcfg is not None and dcfg.lora_backend == "peft":
                for path in dcfg.startup_lora_paths:
                    self.adapter_registry.adopt(startup_lora_request(path), stage.stage_id)

    @property
    def stage_configs(self):
        return self.config.stages

    @cached_property
    def entry_stage_info(self) -> EntryStageInfo:
        """What front ends need to know about this pipeline (output kinds, adapters per
        request, start-up adapters and their default scale, ...); computed once."""
        return describe_entry_stage(self.config, self._orchestrator.descriptions)

    def _stage_params(self, sampling_params: Any) -> list[Any]:
        """One params object per stage.

        ``sampling_params`` may be ``None`` (defaults everywhere), one object, or a list with one
        entry per stage (``None`` entries take the default). One object is the request's params:
        it applies to every stage that takes its type, as the stage describes it (``SamplingParams`` for LLM stages,
        ``OmniDiffusionSamplingParams`` for diffusion stages) **except a later stage with its own
        defaults** (``stage_defaults``: Qwen2.5-Omni's talker, whose tokens are codec tokens, and
        code2wav), which keeps them with the object's seed
        (:func:`~vllm_omni.entrypoints.stage_info.seeded_stage_default`, the HTTP routes' rule too);
        an object of a type only such a stage takes (``AudioParams``) reaches it. Every other stage
        that the object's seed does not reach gets its params with that seed
        (:func:`~vllm_omni.entrypoints.stage_info.seed_unseeded`), so one seeded object makes the
        whole pipeline reproducible. A per-stage list sets any stage's params, as given.

        Raises:
            InvalidRequestError: a per-stage list of the wrong length, or an entry of the wrong type.
        """
        stages = self.config.stages
        defaults = self.entry_stage_info.stage_defaults  # (its first use registers the stage runtimes)
        per_stage = isinstance(sampling_params, list | tuple)
        if per_stage and len(sampling_params) != len(stages):
            raise InvalidRequestError(
                f"sampling_params has {len(sampling_params)} entries but pipeline "
                f"{self.config.pipeline.name!r} has {len(stages)} stages; pass one per stage or a single object"
            )
        kinds = [d.params_type for d in self._orchestrator.descriptions]
        if not per_stage and sampling_params is not None and not isinstance(sampling_params, tuple(kinds)):
            names = " or ".join(sorted({k.__name__ for k in kinds}))
            raise InvalidRequestError(
                f"sampling_params must be {names} (or one per stage) for pipeline "
                f"{self.config.pipeline.name!r}, got {type(sampling_params).__name__}: {sampling_params!r:.200}"
            )
        out = []
        for i, (stage, kind) in enumerate(zip(stages, kinds)):
            params = sampling_params[i] if per_stage else sampling_params
            dedicated = kind not in (SamplingParams, OmniDiffusionSamplingParams)  # e.g. AudioParams
            default = defaults[i] if 0 < i < len(defaults) else None
            if isinstance(params, kind) and (per_stage or default is None or dedicated):
                out.append(params)
            elif default is not None and (params is None or not per_stage):
                out.append(seeded_stage_default(default, None if per_stage else params))
            elif params is None or not per_stage:
                out.append(kind())
            else:
                raise InvalidRequestError(
                    f"sampling_params[{i}] for {stage.label} must be {kind.__name__}, got {type(params).__name__}"
                )
        if per_stage:
            return out
        return [seed_unseeded(p, getattr(sampling_params, "seed", None)) for p in out]

    def _request_adapters(
        self, n: int, stage_params: list[Any], field: str = "adapters", **forms: Any
    ) -> list[dict[int, RequestAdapters]]:
        """Per prompt, ``{stage_id: RequestAdapters}`` from every public adapter form, checked once against
        the stages' descriptions (:func:`~vllm_omni.entrypoints.request_adapters.request_adapters`)."""
        return request_adapters(
            self.config, self._orchestrator.descriptions, n, stage_params, field=field, **forms
        )

    def _check_stage_adapter(self, stage_id: int, lora: Any) -> None:
        """What stage ``stage_id`` would refuse of ``lora``, loading nothing: no LoRA there (or no such
        stage), or, on a vLLM stage, the adapter gate (files, rank, modules; cached per adapter).

        Raises:
            LoRANotEnabledError / ConfigError / InvalidAdapterError: naming the stage.
        """
        self._orchestrator.lora_call("list_loras", stage_id=stage_id)
        index = [s.stage_id for s in self.config.stages].index(stage_id)
        if self._orchestrator.descriptions[index].params_type is SamplingParams:  # a vLLM stage
            self._orchestrator.runtimes[index].validate_request(
                StageRequest(None, SamplingParams(), RequestAdapters.of(lora))
            )

    def _check_multimodal_reach(self, prompt: Any, last_stage: int | None) -> None:
        """Refuse, before it starts, a request whose prompt carries ``multi_modal_data`` (audio, image,
        video) and would run a stage fed by a text-only hand-off (:data:`TEXT_ONLY_HANDOFFS`) that does
        not take ``"media_payload"``.

        Raises:
            InvalidRequestError: naming that stage and the way to run the request (text only).
        """
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return
        entry_id = self.config.entry_stage.stage_id
        for stage, spec in zip(self.config.stages, self.config.pipeline.stages, strict=True):
            runs = stage.stage_id != entry_id and (last_stage is None or stage.stage_id <= last_stage)
            handoff = spec.input_processor
            takes_media = "media_payload" in self._orchestrator.descriptions[stage.stage_id].inputs
            if runs and handoff in TEXT_ONLY_HANDOFFS and not takes_media:
                exc = InvalidRequestError(
                    f"{stage.label}: the talker takes text prompts only: its hand-off ({handoff}) passes on "
                    f"the thinker's token ids without the prompt's {sorted(data)} input, so the reply to this "
                    f"prompt cannot be spoken; ask for text only (last_stage={entry_id}; over HTTP, "
                    'modalities ["text"])'
                )
                exc.param = "multi_modal_data"  # the request field at fault (HTTP errors name it)
                raise exc

    def _stage_denoisers(self, stage_id: int) -> tuple[str, ...] | None:
        """The denoisers adapters bind to on stage ``stage_id`` (``()`` on an LLM stage); ``None`` when
        there is no such stage or it takes no adapters (the registration's own checks say so)."""
        ids = [s.stage_id for s in self.config.stages]
        if stage_id not in ids:
            return None
        adapters = self._orchestrator.descriptions[ids.index(stage_id)].adapters
        return None if adapters is None else adapters.denoisers

    def _versioned(self, adapters: dict[int, RequestAdapters]) -> dict[int, RequestAdapters]:
        """A request's adapters in the per-version form the stages get
        (:meth:`AdapterRegistry.resolve_adapter <vllm_omni.lora.registry.AdapterRegistry.resolve_adapter>`:
        reads the files' signatures), and each later LLM stage's adapter through that stage's adapter gate
        (files, rank, modules), so that a request is refused before it starts.

        Raises:
            InvalidAdapterError: an id that names another adapter, a changed adapter a stage refuses, or a
                later stage's gate (the message names the stage).
        """
        resolve = self.adapter_registry.resolve_adapter
        out = {sid: RequestAdapters(tuple(resolve(a) for a in given)) for sid, given in adapters.items()}
        entry_id = self.config.entry_stage.stage_id
        for sid, given in out.items():
            if sid == entry_id or not given:
                continue
            index = [s.stage_id for s in self.config.stages].index(sid)
            if not self.config.stages[index].is_llm:  # a later diffusion stage's own params: no gate
                continue
            try:
                self._orchestrator.runtimes[index].validate_request(
                    StageRequest(None, SamplingParams(), given)
                )
            except InvalidAdapterError as exc:  # name the entry and the stage it was meant for
                raise restate(exc, f"lora_request[{sid}] for {self.config.stages[index].label}") from exc
        return out

    # ---------------------------------------------------------------- LoRA management
    def _add_lora(
        self,
        lora_request,
        stage_id=None,
        reload: bool = False,
        denoiser: str | None = None,
        replace: bool = True,
    ) -> bool:
        return self.adapter_registry.add(
            lora_request, stage_id, reload=reload, denoiser=denoiser, replace=replace
        )

    def _remove_lora(self, lora_int_id: int, stage_id: int | None = None) -> bool:
        return self.adapter_registry.remove(lora_int_id, stage_id)

    def _list_loras(self, stage_id: int | None = None) -> set[int]:
        return self.adapter_registry.list_ids(stage_id)

    def _pin_lora(self, lora_int_id: int, stage_id: int | None = None) -> bool:
        return self.adapter_registry.pin(lora_int_id, stage_id)

    def stage_stats(self, timeout: float = 5.0) -> dict[int, StageStats | None]:
        """``{stage_id: StageStats}``: each stage's statistics now (plain data, see
        :mod:`vllm_omni.stats`), gathered from its process or actor; ``None`` for a stage that
        did not answer within ``timeout`` seconds (restarting, dead)."""
        return self._orchestrator.stage_stats(timeout)

    def stage_health(self) -> dict[int, str]:
        """``{stage_id: "starting" | "ready" | "restarting" | "dead"}``: whether each stage serves now
        (an ``mp`` / ``ray`` stage is ``"restarting"`` while its dead worker is replaced)."""
        return self._orchestrator.stage_health()

    def failed_loras(self) -> dict[int, dict[int, str]]:
        """``{stage_id: {lora_int_id: error}}``: adapters a worker restart could not restore (their
        files deleted or unreadable); requests naming one are refused with ``AdapterRestoreError``
        until it is added again. ``{}`` when every adapter was restored. The adapter registry's
        record of each shows the same (``stages[stage_id].state == "failed"``)."""
        return self.adapter_registry.failed()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every stage engine; with ``timeout``, within that many seconds (running requests are abandoned)."""
        orch = getattr(self, "_orchestrator", None)
        if orch is not None:
            orch.shutdown(timeout)
