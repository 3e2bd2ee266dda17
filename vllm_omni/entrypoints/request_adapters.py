"""The request-adapter boundary: every public form of a request's adapters, turned into one value and checked once.

``Omni.generate`` / ``AsyncOmni.generate`` take a request's adapters as ``lora_request`` (one adapter, a
per-prompt list, or a ``{stage_id: adapter}`` dict), ``lora_scale``, ``lora_requests`` / ``lora_scales``
(composed diffusion adapters, for every prompt or per prompt), ``adapters`` (``RequestAdapter`` s, the
HTTP layer's form) or the fields of ``OmniDiffusionSamplingParams``. :func:`request_adapters` turns them
into, per prompt, ``{stage_id: RequestAdapters}`` and checks each stage's value against what that stage
says about itself (its :class:`~vllm_omni.engine.protocols.StageDescription`: LoRA enabled or not,
LLM or diffusion, adapters per request, denoisers): the one place that knows the shapes and the one
place their rules are checked (:func:`check_stage_adapters`). Stages, workers and the diffusion LoRA
manager receive the value unchanged; the engine's adapter registry then versions it
(``OmniBase._versioned``).

The flow, from the edge to the layer::

    lora_request / lora_scale / lora_requests / lora_scales / adapters / params.lora_requests / HTTP lora
        -> request_adapters()            one converter; check_stage_adapters() against describe()
        -> {stage_id: RequestAdapters}   per prompt
        -> AdapterRegistry.resolve_*     per-version identity (files read off the event loop)
        -> StageRequest(prompt, params, adapters, on_partial) -> StageRuntime.submit
        -> diffusion worker / LLM stage  -> DiffusionLoRAManager / vLLM LoRA
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.engine.protocols import StageDescription
from vllm_omni.errors import InvalidRequestError, LoRANotEnabledError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import (
    RequestAdapter,
    RequestAdapters,
    assign_denoisers,
    gather_request_adapters,
    llm_stage_adapter,
    lora_request_problem,
    validate_request_adapters,
)

#: What one prompt's adapters are before the check: ``{stage_id: tuple[RequestAdapter, ...]}``.
_Raw = dict[int, tuple[RequestAdapter, ...]]


def request_adapters(
    config: VllmOmniConfig,
    descriptions: Sequence[StageDescription],
    n: int,
    stage_params: Sequence[Any],
    *,
    lora_request: Any = None,
    lora_scale: Any = None,
    lora_requests: Any = None,
    lora_scales: Any = None,
    adapters: Sequence[RequestAdapter] | None = None,
    field: str = "adapters",
) -> list[dict[int, RequestAdapters]]:
    """Per prompt (``n`` of them): ``{stage_id: RequestAdapters}`` for every stage the request gives adapters.

    Args:
        stage_params: one params object per stage; a diffusion stage's ``lora_requests`` /
            ``lora_scales`` (``OmniDiffusionSamplingParams``) are that stage's adapters (submit the params
            through :func:`without_params_loras` afterwards: one form reaches the stage).
        lora_request, lora_scale, lora_requests, lora_scales, adapters: ``generate``'s public forms.
        field: the name of ``adapters`` in messages (the HTTP layer passes ``"lora"``).

    ``lora_request`` given as a list (one per prompt) drops ``lora_scale`` for prompts without an adapter
    instead of refusing it.

    Raises:
        InvalidRequestError / LoRANotEnabledError: the rules of :func:`per_prompt_loras`,
            :func:`entry_adapters` and :func:`check_stage_adapters`.
    """
    try:
        return _request_adapters(
            config,
            descriptions,
            n,
            stage_params,
            lora_request,
            lora_scale,
            lora_requests,
            lora_scales,
            adapters,
            field,
        )
    except InvalidRequestError as exc:  # the request field at fault (HTTP: the error's "param")
        if getattr(exc, "param", None) is None:
            exc.param = field
        raise


def _request_adapters(
    config: VllmOmniConfig,
    descriptions: Sequence[StageDescription],
    n: int,
    stage_params: Sequence[Any],
    lora_request: Any,
    lora_scale: Any,
    lora_requests: Any,
    lora_scales: Any,
    adapters: Sequence[RequestAdapter] | None,
    field: str,
) -> list[dict[int, RequestAdapters]]:
    entry_params = stage_params[0] if stage_params else None
    loras, entry_given, stage_loras = per_prompt_loras(config, lora_request, n, adapters)
    entries = entry_adapters(
        config,
        loras,
        entry_params,
        lora_scale,
        lora_requests,
        lora_scales,
        scale_needs_adapter=not isinstance(lora_request, list),
        adapters=entry_given,
        field=field,
    )
    entry_id = config.entry_stage.stage_id
    fields = {entry_id: field if entry_given is not None else "lora_requests"}
    own = {  # later diffusion stages' adapters in their own params (e.g. llm_to_diffusion's image stage)
        i: gather_request_adapters(_params_loras(p), validate=False)
        for i, p in enumerate(stage_params)
        if i != entry_id and _params_loras(p)[0]
    }
    out = []
    for entry, later in zip(entries, stage_loras, strict=True):
        raw: _Raw = {entry_id: entry} if entry else {}
        raw.update({sid: tuple(items) for sid, items in later.items()})
        checked = {
            sid: check_stage_adapters(
                config, descriptions, sid, items, fields.get(sid, field), _steps(stage_params, sid)
            )
            for sid, items in raw.items()
        }
        for sid, items in own.items():
            if sid in checked:
                raise InvalidRequestError(
                    f"{config.stages[sid].label}: adapters given both in its params' lora_requests and in the request"
                )
            checked[sid] = check_stage_adapters(
                config, descriptions, sid, items, "lora_requests", _steps(stage_params, sid), own_params=True
            )
        out.append(checked)
    return out


def _steps(stage_params: Sequence[Any], stage_id: int) -> int | None:
    params = stage_params[stage_id] if 0 <= stage_id < len(stage_params) else None
    return getattr(params, "num_inference_steps", None)


def check_stage_adapters(
    config: VllmOmniConfig,
    descriptions: Sequence[StageDescription],
    stage_id: int,
    items: Sequence[RequestAdapter],
    field: str = "adapters",
    num_steps: int | None = None,
    *,
    own_params: bool = False,
) -> RequestAdapters:
    """The one check of a request's adapters on one stage, against what the stage describes about itself.

    Args:
        stage_id: the stage the adapters are for (the entry stage, or a later LLM stage the request names).
        items: the adapters, in request order.
        field: their public name, for messages.
        num_steps: the request's denoising steps (diffusion): per-step scale lists must have that many.
        own_params: the adapters came in the stage's own params (a later diffusion stage may take them so).

    Returns:
        The checked value (scales parsed, denoiser aliases resolved).

    Raises:
        InvalidRequestError: ``stage_id`` is not a stage of the pipeline; a later stage that is not an
            LLM stage; an LLM stage given more than one adapter, a scale or a denoiser; more adapters than
            the stage takes per request; a list rule of :func:`~vllm_omni.lora.request.validate_request_adapters`;
            a denoiser the stage lacks.
        LoRANotEnabledError: the stage has no LoRA enabled (the message names the stage and the option).
    """
    n = len(config.stages)
    if isinstance(stage_id, bool) or not isinstance(stage_id, int) or not 0 <= stage_id < n:
        raise InvalidRequestError(
            f"lora_request names stage {stage_id!r}, but pipeline {config.pipeline.name!r} "
            f"has stages 0..{n - 1} (stage 0, the entry stage, takes the request's own adapter)"
        )
    stage, description = config.stages[stage_id], descriptions[stage_id]
    caps = description.adapters
    if stage_id != config.entry_stage.stage_id and not stage.is_llm and not own_params:
        raise InvalidRequestError(
            f"lora_request names {stage.label}: per-stage request adapters apply to LLM stages only"
        )
    if caps is None:
        raise LoRANotEnabledError(_not_enabled(stage, description))
    if caps.kind == "llm":
        checked = validate_request_adapters(tuple(items), field=field)
        llm_stage_adapter(checked, stage.label)
        return RequestAdapters(checked)
    checked = validate_request_adapters(tuple(items), caps.max_per_request, field=field, num_steps=num_steps)
    if caps.denoisers:
        assign_denoisers(checked, caps.denoisers, stage.label)
    return RequestAdapters(checked)


def _not_enabled(stage: Any, description: StageDescription) -> str:
    if not stage.is_llm:
        return f"{stage.label} ({description.output_kind}) takes no adapter"
    return (
        f"{stage.label} does not have LoRA enabled; set enable_lora=True on this stage "
        f"(Omni(..., enable_lora=True) for a single-stage pipeline, or "
        f'stage_overrides={{"{stage.stage_id}": {{"enable_lora": true}}}})'
    )


def entry_adapters(
    config: VllmOmniConfig,
    loras: list[Any],
    entry_params: Any,
    lora_scale: Any,
    lora_requests: Any,
    lora_scales: Any,
    *,
    scale_needs_adapter: bool = True,
    adapters: Sequence[RequestAdapter] | None = None,
    field: str = "adapters",
) -> list[tuple[RequestAdapter, ...]]:
    """Per prompt, the entry stage's adapters from whichever public form carried them (not yet checked).

    Args:
        loras: one ``lora_request`` (or ``None``) per prompt.
        entry_params: the entry stage's sampling params (a diffusion stage's may carry ``lora_requests``).
        lora_scale: scale of each prompt's ``lora_request``.
        lora_requests / lora_scales: one list for every prompt, or one list per prompt.
        scale_needs_adapter: ``False`` drops ``lora_scale`` for prompts without an adapter
            (``lora_request`` given per prompt) instead of refusing it.
        adapters: the entry stage's adapters already as ``RequestAdapter`` (the HTTP layer's form);
            the other adapter arguments must then be absent.

    Raises:
        InvalidRequestError: adapters given in two forms, diffusion-only forms on an LLM entry stage,
            or per-prompt lists of the wrong length.
    """
    n_prompts = len(loras)
    entry = config.entry_stage
    params_loras = _params_loras(entry_params)
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
        if params_loras[0]:
            raise InvalidRequestError(
                f"pass a request's adapters either as {field} or as OmniDiffusionSamplingParams.lora_requests"
            )
        return [tuple(adapters)] * n_prompts
    if entry.is_llm:
        if lora_scale is not None or lora_requests is not None or lora_scales is not None:
            raise InvalidRequestError(
                f"lora_scale / lora_requests / lora_scales apply to diffusion stages; the entry stage is "
                f"{entry.label}, which takes one adapter per request through lora_request"
            )
        for lr in loras:
            problem = None if lr is None else lora_request_problem(lr)
            if problem is not None:
                raise InvalidRequestError(f"lora_request {problem}")
        return [() if lr is None else (RequestAdapter(lr),) for lr in loras]
    per = _per_prompt_lists(n_prompts, lora_requests, lora_scales)
    return [
        gather_request_adapters(
            params_loras,
            lr,
            lora_scale if lr is not None or scale_needs_adapter else None,
            reqs,
            scales,
            validate=False,  # check_stage_adapters runs the list rules once, per stage
        )
        for lr, (reqs, scales) in zip(loras, per, strict=True)
    ]


def _params_loras(entry_params: Any) -> tuple[Sequence[Any], Sequence[Any]]:
    if isinstance(entry_params, OmniDiffusionSamplingParams):
        return entry_params.lora_requests, entry_params.lora_scales
    return (), ()


def _per_prompt_lists(n_prompts: int, lora_requests: Any, lora_scales: Any) -> list[tuple[Any, Any]]:
    """``(lora_requests, lora_scales)`` per prompt: one list for every prompt, or one list per prompt.

    Raises:
        InvalidRequestError: per-prompt lists whose number is not the number of prompts.
    """
    nested = bool(lora_requests) and all(isinstance(x, list | tuple) for x in lora_requests)
    if not nested:
        return [(lora_requests, lora_scales)] * n_prompts
    if len(lora_requests) != n_prompts:
        raise InvalidRequestError(f"got {len(lora_requests)} lora_requests lists for {n_prompts} prompts")
    scales = lora_scales if lora_scales is not None else [None] * n_prompts
    if len(scales) != n_prompts or not all(s is None or isinstance(s, list | tuple) for s in scales):
        raise InvalidRequestError(
            "with one lora_requests list per prompt, pass one lora_scales list per prompt"
        )
    return list(zip(lora_requests, scales, strict=True))


def without_params_loras(params: Any) -> Any:
    """Diffusion params whose ``lora_requests`` / ``lora_scales`` were moved into the request's adapters
    (a copy without them; anything else unchanged), so that only one form reaches the stage."""
    if isinstance(params, OmniDiffusionSamplingParams) and (params.lora_requests or params.lora_scales):
        return dataclasses.replace(params, lora_requests=[], lora_scales=[])
    return params


def per_prompt_loras(
    config: VllmOmniConfig, lora_request: Any, n: int, adapters: Sequence[RequestAdapter] | None
) -> tuple[list[Any], Sequence[RequestAdapter] | None, list[dict[int, list[RequestAdapter]]]]:
    """``Omni.generate``'s adapters per prompt: (entry-stage ``lora_request`` per prompt,
    the entry stage's ``adapters``, ``{later stage id: [RequestAdapter]}`` per prompt).

    Raises:
        InvalidRequestError: a ``lora_request`` list whose length is not ``n``, or a key of a
            ``{stage_id: adapter}`` dict that is not an ``int``.
    """
    if isinstance(lora_request, list):
        if len(lora_request) != n:
            raise InvalidRequestError(f"got {len(lora_request)} lora_request entries for {n} prompts")
        split = [_split_stage_loras(config, lr) for lr in lora_request]
    else:
        split = [_split_stage_loras(config, lora_request)] * n
    entry_id = config.entry_stage.stage_id
    entry_given = None if adapters is None else tuple(a for a in adapters if a.stage_id in (None, entry_id))
    by_stage: dict[int, list[RequestAdapter]] = {}
    for a in adapters or ():
        if a.stage_id not in (None, entry_id):
            by_stage.setdefault(a.stage_id, []).append(a)
    later = [{**{sid: [RequestAdapter(lora)] for sid, lora in lat.items()}, **by_stage} for _, lat in split]
    return [entry for entry, _ in split], entry_given, later


def _split_stage_loras(config: VllmOmniConfig, lora_request: Any) -> tuple[Any, dict[int, Any]]:
    """``lora_request`` as (the entry stage's adapter, ``{later stage id: adapter}``).

    A ``LoRARequest`` (or ``None``) keeps its meaning: the entry stage's adapter. A dict
    keyed by stage id (per-stage request adapters, an opt-in extension) gives each named
    stage its own adapter; the entry stage's key is its id (0).

    Raises:
        InvalidRequestError: a key that is not an ``int``.
    """
    if not isinstance(lora_request, dict):
        return lora_request, {}
    entry_id = config.entry_stage.stage_id
    later: dict[int, Any] = {}
    for stage_id, lora in lora_request.items():
        if isinstance(stage_id, bool) or not isinstance(stage_id, int):
            raise InvalidRequestError(
                f"lora_request keys must be stage ids (int), got {stage_id!r:.50}; "
                f"pipeline {config.pipeline.name!r} has stages 0..{len(config.stages) - 1}"
            )
        if stage_id != entry_id and lora is not None:
            problem = lora_request_problem(lora)
            if problem is not None:
                raise InvalidRequestError(f"lora_request[{stage_id}] {problem}")
            later[stage_id] = lora
    return lora_request.get(entry_id), later
