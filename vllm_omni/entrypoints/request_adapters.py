"""The request-adapter boundary: every public form of a request's adapters, turned into one form.

``Omni.generate`` / ``AsyncOmni.generate`` take a request's adapters as ``lora_request`` (one adapter, a
per-prompt list, or a ``{stage_id: adapter}`` dict), ``lora_scale``, ``lora_requests`` / ``lora_scales``
(composed diffusion adapters, for every prompt or per prompt), ``adapters`` (``RequestAdapter`` s, the
HTTP layer's form) or the fields of ``OmniDiffusionSamplingParams``. :func:`request_loras` turns them
into, per prompt, the entry stage's arguments (``{"adapters": tuple[RequestAdapter, ...]}`` on a
diffusion stage, ``{"lora_request": ...}`` on an LLM stage) and ``{later stage id: LoRARequest}``; the
engine's adapter registry then versions them (``OmniBase._versioned``). This is the one place that
knows the shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.request import (
    RequestAdapter,
    gather_request_adapters,
    llm_stage_adapter,
    validate_request_adapters,
)


def request_loras(
    config: VllmOmniConfig,
    n: int,
    entry_params: Any,
    *,
    lora_request: Any = None,
    lora_scale: Any = None,
    lora_requests: Any = None,
    lora_scales: Any = None,
    adapters: Sequence[RequestAdapter] | None = None,
) -> list[tuple[dict[str, Any], dict[int, Any]]]:
    """Per prompt (``n`` of them): (entry-stage adapter arguments, ``{later stage id: LoRARequest}``).

    ``lora_request`` given as a list (one per prompt) drops ``lora_scale`` for prompts without an adapter
    instead of refusing it.

    Raises:
        InvalidRequestError: the rules of :func:`per_prompt_loras` and :func:`entry_lora_kwargs`.
    """
    loras, adapters, stage_loras = per_prompt_loras(config, lora_request, n, adapters)
    kwargs = entry_lora_kwargs(
        config,
        loras,
        entry_params,
        lora_scale,
        lora_requests,
        lora_scales,
        scale_needs_adapter=not isinstance(lora_request, list),
        adapters=adapters,
    )
    return list(zip(kwargs, stage_loras, strict=True))


def entry_lora_kwargs(
    config: VllmOmniConfig,
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
    entry = config.entry_stage
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
        return [_entry_adapter_kwargs(config, adapters, entry_params)] * n_prompts
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
            raise InvalidRequestError(f"got {len(lora_requests)} lora_requests lists for {n_prompts} prompts")
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


def _entry_adapter_kwargs(
    config: VllmOmniConfig, adapters: Sequence[RequestAdapter], entry_params: Any
) -> dict[str, Any]:
    """Entry-stage keyword arguments for adapters given as ``RequestAdapter`` (see above).

    Raises:
        InvalidRequestError: a list rule, adapters also in ``entry_params``, or (LLM entry
            stage) more than one adapter or a scale other than 1.0.
    """
    entry = config.entry_stage
    adapters = validate_request_adapters(tuple(adapters), field="adapters")
    if entry.is_llm:
        return {"lora_request": llm_stage_adapter(adapters, entry.label)}
    if entry_params.lora_requests:
        raise InvalidRequestError(
            "pass a request's adapters either as adapters or as OmniDiffusionSamplingParams.lora_requests"
        )
    return {"adapters": adapters}


def per_prompt_loras(
    config: VllmOmniConfig, lora_request: Any, n: int, adapters: Sequence[RequestAdapter] | None
) -> tuple[list[Any], Sequence[RequestAdapter] | None, list[dict[int, Any]]]:
    """``Omni.generate``'s adapters per prompt: (entry-stage ``lora_request`` per prompt,
    the entry stage's ``adapters``, ``{later stage id: adapter}`` per prompt).

    Raises:
        InvalidRequestError: a ``lora_request`` list whose length is not ``n``, or a rule of
            :func:`_split_stage_loras` / :func:`_split_stage_adapters`.
    """
    if isinstance(lora_request, list):
        if len(lora_request) != n:
            raise InvalidRequestError(f"got {len(lora_request)} lora_request entries for {n} prompts")
        split = [_split_stage_loras(config, lr) for lr in lora_request]
    else:
        split = [_split_stage_loras(config, lora_request)] * n
    adapters, adapter_stage_loras = _split_stage_adapters(config, adapters)
    return (
        [entry for entry, _ in split],
        adapters,
        [{**later, **adapter_stage_loras} for _, later in split],
    )


def _split_stage_loras(config: VllmOmniConfig, lora_request: Any) -> tuple[Any, dict[int, Any]]:
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
    entry_id = config.entry_stage.stage_id
    later: dict[int, Any] = {}
    for stage_id, lora in lora_request.items():
        if isinstance(stage_id, bool) or not isinstance(stage_id, int):
            raise InvalidRequestError(
                f"lora_request keys must be stage ids (int), got {stage_id!r:.50}; "
                f"pipeline {config.pipeline.name!r} has stages 0..{len(config.stages) - 1}"
            )
        if stage_id != entry_id and lora is not None:
            later[stage_id] = lora
    return lora_request.get(entry_id), later


def _split_stage_adapters(
    config: VllmOmniConfig, adapters: Sequence[RequestAdapter] | None
) -> tuple[Sequence[RequestAdapter] | None, dict[int, Any]]:
    """``adapters`` (the HTTP layer's form) as (the entry stage's, ``{later stage id: LoRARequest}``).

    Raises:
        InvalidRequestError: two adapters for one later stage, or one with a scale other than 1.0
            (an LLM stage applies one adapter per request, at scale 1.0).
    """
    if adapters is None:
        return None, {}
    entry_id = config.entry_stage.stage_id
    entry = [a for a in adapters if a.stage_id in (None, entry_id)]
    by_stage: dict[int, list[RequestAdapter]] = {}
    for a in adapters:
        if a.stage_id not in (None, entry_id):
            by_stage.setdefault(a.stage_id, []).append(a)
    later = {
        stage_id: llm_stage_adapter(
            validate_request_adapters(tuple(given), field="adapters"), f"stage {stage_id}"
        )
        for stage_id, given in by_stage.items()
    }
    return tuple(entry), later
