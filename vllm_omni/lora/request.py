"""The request type for LoRA adapters, shared by LLM and diffusion stages.

``LoRARequest`` is vLLM's own class (``vllm.lora.request.LoRARequest``), re-exported so
that an adapter built for an LLM stage and one built for a diffusion stage are the same
object type: ``LoRARequest(lora_name, lora_int_id, lora_path)``. ``lora_int_id`` must be
a positive integer unique per adapter; :func:`stable_lora_int_id` derives one from a
path when the caller has none.

:class:`RequestAdapter` is one adapter of one request with its scale. The public inputs
(``generate``'s ``lora_request`` / ``lora_scale`` / ``lora_requests`` / ``lora_scales`` and the
fields of ``OmniDiffusionSamplingParams``) become a tuple of them once, at the entry point
(:func:`gather_request_adapters`), and travel unchanged to the diffusion worker; the list rules
live in :func:`validate_request_adapters` only.

Denoiser targets (two-denoiser diffusion stages such as Wan2.2's MoE: ``transformer`` is the
high-noise expert, ``transformer_2`` the low-noise one) follow one rule, :func:`assign_denoisers`,
in every backend: an adapter's ``denoiser`` names its target (aliases ``high_noise`` /
``low_noise``); a request whose adapters name none follows the ``[high_noise, low_noise]``
convention of diffusers' ``load_into_transformer_2`` and of ``lora_path`` (the i-th adapter on the
i-th denoiser); anything else ambiguous is refused with a message that says how to name the target.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.lora.request import LoRARequest

from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.schedule import MAX_ADAPTER_SCALE, LoRAScaleSchedule, coerce_number, coerce_scale
from vllm_omni.lora.tensor_request import TensorLoRARequest

__all__ = [
    "DENOISER_ALIASES",
    "MAX_ADAPTER_SCALE",
    "LoRARequest",
    "LoRAScaleSchedule",
    "NO_ADAPTERS",
    "RequestAdapter",
    "TensorLoRARequest",
    "RequestAdapters",
    "assign_denoisers",
    "canonical_denoiser",
    "gather_request_adapters",
    "stable_lora_int_id",
    "startup_lora_request",
    "to_request_adapters",
    "validate_request_adapters",
]


#: Names of the two denoisers of a Wan2.2-style MoE stage, and their aliases (diffusers' attributes:
#: ``transformer`` runs the high-noise steps, ``transformer_2`` the low-noise ones).
DENOISER_ALIASES: dict[str, str] = {
    "transformer": "transformer",
    "transformer_2": "transformer_2",
    "high_noise": "transformer",
    "low_noise": "transformer_2",
}
_HOW_TO_NAME = (
    'name each adapter\'s denoiser: RequestAdapter(..., denoiser="transformer") or "high_noise" for the '
    'high-noise expert, "transformer_2" or "low_noise" for the low-noise one (HTTP: "denoiser" in the lora '
    "object); a request whose adapters name none means [high_noise, low_noise] by position"
)


def canonical_denoiser(value: Any, where: str) -> str | None:
    """``value`` as a denoiser attribute (``"transformer"`` / ``"transformer_2"``), aliases resolved.

    Raises:
        InvalidRequestError: not ``None`` and not one of :data:`DENOISER_ALIASES` (``where`` names it).
    """
    if value is None:
        return None
    name = DENOISER_ALIASES.get(value) if isinstance(value, str) else None
    if name is None:
        raise InvalidRequestError(
            f"{where}: unknown denoiser {value!r}; use one of {sorted(DENOISER_ALIASES)}"
        )
    return name


def _adapter_label(adapter: RequestAdapter, i: int) -> str:
    return f"adapter {i} (LoRA {adapter.lora.lora_int_id}, {adapter.lora.lora_name!r})"


def assign_denoisers(adapters: Sequence[RequestAdapter], denoisers: Sequence[str], stage: str) -> list[str]:
    """The denoiser each adapter of one request acts on (the module docstring's rule).

    Args:
        adapters: the request's adapters on this stage, in order (``denoiser`` already canonical).
        denoisers: the stage's denoiser attributes, primary first (``["transformer"]``, or
            ``["transformer", "transformer_2"]`` on a Wan2.2-style MoE stage).
        stage: the stage's label, for messages.

    Returns:
        One denoiser attribute per adapter.

    Raises:
        InvalidRequestError: a named denoiser the stage lacks; on a stage with several denoisers,
            named and unnamed adapters mixed in one request, or more unnamed adapters than
            denoisers. Every message names the adapter and says how to name the target.
    """
    named = [a.denoiser for a in adapters]
    for i, (adapter, name) in enumerate(zip(adapters, named, strict=True)):
        if name is not None and name not in denoisers:
            raise InvalidRequestError(
                f"{stage}: {_adapter_label(adapter, i)} names denoiser {name!r}, but this stage's denoisers "
                f"are {list(denoisers)}"
            )
    if len(denoisers) == 1:
        return [denoisers[0]] * len(adapters)
    if all(name is not None for name in named):
        return [name for name in named if name is not None]
    if any(name is not None for name in named):
        unnamed = [_adapter_label(a, i) for i, a in enumerate(adapters) if a.denoiser is None]
        raise InvalidRequestError(
            f"{stage} has denoisers {list(denoisers)}; {', '.join(unnamed)} name none while others do, so "
            f"the target is ambiguous: {_HOW_TO_NAME}"
        )
    if len(adapters) > len(denoisers):
        raise InvalidRequestError(
            f"{stage} has denoisers {list(denoisers)} but the request lists {len(adapters)} adapters without "
            f"a denoiser; by position the first goes to {denoisers[0]!r}, the second to {denoisers[1]!r}, and "
            f"{_adapter_label(adapters[len(denoisers)], len(denoisers))} has none: {_HOW_TO_NAME}"
        )
    return list(denoisers[: len(adapters)])


def stable_lora_int_id(path: str) -> int:
    """Deterministic positive 31-bit id for an adapter location.

    The id is ``sha256(realpath(path))`` truncated to 31 bits (0 mapped to 1), so it is
    stable across processes and restarts, and two different paths practically never
    share an id.
    """
    key = os.path.realpath(path) if "://" not in path else path
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    value = int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
    return value or 1


def startup_lora_request(path: str) -> LoRARequest:
    """The ``LoRARequest`` under which a diffusion stage pre-loads a ``lora_path`` adapter: named after
    the file or folder, id :func:`stable_lora_int_id` of the path.

    A local path is held as its real path, the spelling the id is derived from and the one an HTTP
    request naming the same adapter resolves to: a relative ``lora_path`` and a request's absolute path
    then name one cache entry, not two that clash on one id.
    """
    name = os.path.basename(os.path.normpath(path)) or "startup"
    location = path if "://" in path else os.path.realpath(path)
    return LoRARequest(lora_name=name, lora_int_id=stable_lora_int_id(location), lora_path=location)


@dataclass(frozen=True)
class RequestAdapter:
    """One adapter of one request, as carried from the entry point to the diffusion worker.

    Attributes:
        lora: the adapter (``lora_int_id`` positive, ``lora_path`` set).
        scale: its weight in this request; ``None`` takes the stage default (``1.0``, or the
            stage's ``lora_scale`` for an adapter pre-loaded from ``lora_path``). ``0`` adds
            nothing; a negative scale negates the adapter's delta. A
            :class:`~vllm_omni.lora.schedule.LoRAScaleSchedule` varies it per step and per block
            (diffusion stages).
        stage_id: the stage it applies to; ``None`` is the entry stage (the default meaning of
            a request's adapter). A later stage must be an LLM stage with LoRA enabled
            (per-stage request adapters, an opt-in extension).
        denoiser: on a diffusion stage, the denoiser it acts on: ``"transformer"`` (alias
            ``"high_noise"``) or ``"transformer_2"`` (alias ``"low_noise"``); ``None`` follows
            :func:`assign_denoisers` (by position on a two-denoiser stage). Aliases become the
            attribute name in :func:`validate_request_adapters`.
        text_encoder_scale: on a diffusion stage, its weight on the text encoder(s) when its file has
            text-encoder parts (ComfyUI's "clip strength"); ``None`` takes :attr:`scale` (for a schedule,
            the stage default). A finite number, no schedule: the prompt is encoded once.
    """

    lora: LoRARequest
    scale: float | LoRAScaleSchedule | None = None
    stage_id: int | None = None
    denoiser: str | None = None
    text_encoder_scale: float | None = None


@dataclass(frozen=True)
class RequestAdapters:
    """One request's adapters on one stage: the single value that carries them from the API edge
    (:func:`vllm_omni.entrypoints.request_adapters.request_adapters`, which builds it from every
    public form and checks it against the stage's description once) through
    :class:`~vllm_omni.inputs.stage_request.StageRequest`, the stage runtime and its worker, to the
    diffusion LoRA manager.

    Attributes:
        items: the adapters in request order (an empty tuple: the base model).

    An LLM stage reads :attr:`lora_request` (vLLM applies one adapter per request, at scale 1.0);
    a diffusion stage iterates the items (composed adapters, scales or schedules, denoisers).
    """

    items: tuple[RequestAdapter, ...] = ()

    @classmethod
    def of(
        cls, lora_request: LoRARequest | None, scale: float | LoRAScaleSchedule | None = None
    ) -> RequestAdapters:
        """One adapter at ``scale`` (``None``: the stage default), or none for ``lora_request=None``."""
        return cls() if lora_request is None else cls((RequestAdapter(lora_request, scale),))

    @classmethod
    def composed(
        cls, lora_requests: Sequence[LoRARequest], scales: Sequence[float | LoRAScaleSchedule | None] = ()
    ) -> RequestAdapters:
        """Several adapters composed in one request, one scale each (empty ``scales``: the defaults).

        Raises:
            InvalidRequestError: ``scales`` given with another length than ``lora_requests``.
        """
        if scales and len(scales) != len(lora_requests):
            raise InvalidRequestError(
                f"{len(scales)} scales for {len(lora_requests)} adapters; give one per adapter or none"
            )
        scales = list(scales) or [None] * len(lora_requests)
        return cls(tuple(RequestAdapter(r, s) for r, s in zip(lora_requests, scales, strict=True)))

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def lora_request(self) -> LoRARequest | None:
        """The adapter of an LLM stage's request (``None``: the base model).

        Raises:
            InvalidRequestError: more than one adapter (only a diffusion stage composes adapters).
        """
        if len(self.items) > 1:
            raise InvalidRequestError(f"an LLM stage applies one adapter per request, got {len(self.items)}")
        return self.items[0].lora if self.items else None

    @property
    def ids(self) -> tuple[int, ...]:
        """The adapters' ``lora_int_id`` in request order."""
        return tuple(a.lora.lora_int_id for a in self.items)


#: A request on the base model (no adapter).
NO_ADAPTERS = RequestAdapters()


def lora_request_problem(lora: Any) -> str | None:
    """What makes ``lora`` unusable as an adapter (worded to follow the adapter's place, e.g.
    ``lora_requests[1] must be ...``), or ``None``. It must be a vLLM ``LoRARequest`` with a
    positive ``int`` ``lora_int_id`` (not a ``bool``) and a non-empty ``lora_path``.

    The one check of an adapter's identity fields, shared by request validation
    (:func:`validate_request_adapters`), registration
    (:func:`vllm_omni.lora.records.checked_lora_request`), the LLM stage's adapter gate and the
    diffusion activation; each adds where the adapter came from.
    """
    lora_id = getattr(lora, "lora_int_id", None)
    if (
        not isinstance(lora, LoRARequest)
        or isinstance(lora_id, bool)
        or not isinstance(lora_id, int)
        or lora_id < 1
    ):
        return f"must be a LoRARequest(lora_name, lora_int_id, lora_path) with a positive lora_int_id, got {lora!r:.200}"
    if not lora.lora_path:
        return f"has no lora_path (LoRA {lora_id}, {lora.lora_name!r})"
    return None


def llm_stage_adapter(adapters: Sequence[RequestAdapter], stage: str) -> LoRARequest | None:
    """The one adapter an LLM stage applies to a request, or ``None`` for none.

    vLLM applies one ``LoRARequest`` per request at scale 1.0; an LLM stage has no denoisers. The
    one statement of that rule, for every path that gives an LLM stage adapters (``Omni``'s
    ``adapters=``, later stages' entries, the HTTP ``lora`` field).

    Args:
        adapters: the adapters given for that stage.
        stage: the stage as messages name it (``"Stage 0 (llm)"``, ``"stage 1"``).

    Raises:
        InvalidRequestError: more than one adapter, a scale other than 1.0, or a denoiser.
    """
    if len(adapters) > 1 or any(
        isinstance(a.scale, bool)
        or a.scale not in (None, 1.0)
        or a.denoiser is not None
        or a.text_encoder_scale is not None
        for a in adapters
    ):
        raise InvalidRequestError(
            f"{stage}: an LLM stage applies one adapter per request, at scale 1.0, with no denoiser or "
            "text_encoder_scale (denoisers and scales belong to diffusion stages)"
        )
    return adapters[0].lora if adapters else None


def validate_request_adapters(
    adapters: Sequence[RequestAdapter],
    max_loras: int | None = None,
    *,
    field: str = "lora_requests",
    num_steps: int | None = None,
) -> tuple[RequestAdapter, ...]:
    """The list rules of one request's adapters (no file is read).

    Args:
        adapters: the request's adapters, in order.
        max_loras: the stage's limit on adapters per request, when known.
        field: the public name of the adapter list, for messages.
        num_steps: the request's ``num_inference_steps``, when known: per-step scale lists must
            have that many values.

    Returns:
        ``adapters`` as a tuple, scales as ``float`` or :class:`LoRAScaleSchedule` (lists and
        ``{"steps", "blocks"}`` dicts are parsed into one).

    Raises:
        InvalidRequestError: more than ``max_loras`` adapters, an entry that is not a
            ``LoRARequest`` with a positive ``lora_int_id`` and a ``lora_path``, the same
            ``lora_int_id`` twice for one stage and denoiser, an unknown ``denoiser``, a scale that is not a finite number in
            ``[-MAX_ADAPTER_SCALE, MAX_ADAPTER_SCALE]`` or a valid schedule (see
            :meth:`LoRAScaleSchedule.parse`), or a per-step list whose length is not ``num_steps``;
            the message names the field and position (``lora_requests[1]``, ``lora_scales[1]``),
            the adapter, or ``max_loras``.
    """
    if max_loras is not None and len(adapters) > max_loras:
        raise InvalidRequestError(
            f"{len(adapters)} adapters in one request exceed max_loras={max_loras} of the diffusion stage; "
            f"raise max_loras or compose fewer adapters"
        )
    seen: set[tuple[int | None, str | None, int]] = set()  # an adapter may serve two stages or denoisers
    out = []
    for i, adapter in enumerate(adapters):
        if not isinstance(adapter, RequestAdapter):
            raise InvalidRequestError(f"{field}[{i}] must be a RequestAdapter, got {type(adapter).__name__}")
        lora, scale = adapter.lora, adapter.scale
        problem = lora_request_problem(lora)
        if problem is not None:
            raise InvalidRequestError(f"{field}[{i}] {problem}")
        lora_id = lora.lora_int_id
        denoiser = canonical_denoiser(
            adapter.denoiser,
            f"{field}[{i}].denoiser (LoRA {lora_id}, {lora.lora_name!r})",
        )
        if (adapter.stage_id, denoiser, lora_id) in seen:
            raise InvalidRequestError(
                f"{field}[{i}]: LoRA {lora_id} appears twice for the same stage and denoiser; list each adapter once"
            )
        seen.add((adapter.stage_id, denoiser, lora_id))
        scale_name = f"lora_scales[{i}]" if field == "lora_requests" else f"{field}[{i}].scale"
        try:
            value = coerce_scale(scale, scale_name)
            if isinstance(value, LoRAScaleSchedule) and num_steps is not None:
                value.check_steps(num_steps, scale_name)
            te_scale = _text_encoder_scale(adapter.text_encoder_scale, f"{field}[{i}].text_encoder_scale")
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{exc} (LoRA {lora_id}, {lora.lora_name!r})") from None
        same = value is scale and denoiser == adapter.denoiser and te_scale is adapter.text_encoder_scale
        out.append(adapter if same else RequestAdapter(lora, value, adapter.stage_id, denoiser, te_scale))
    return tuple(out)


def _text_encoder_scale(value: Any, where: str) -> float | None:
    """A ``text_encoder_scale`` as ``None`` or a finite ``float`` within the scale limits.

    Raises:
        InvalidRequestError: a schedule (a list or dict), or what :func:`coerce_scale` refuses.
    """
    if isinstance(value, LoRAScaleSchedule | Mapping | list | tuple):
        raise InvalidRequestError(
            f"{where} must be a number (the prompt is encoded once, so it has no per-step or per-block "
            f"schedule), got {type(value).__name__}"
        )
    return None if value is None else coerce_number(value, where)


def to_request_adapters(
    lora_requests: Any,
    lora_scales: Any = None,
    max_loras: int | None = None,
    *,
    num_steps: int | None = None,
    validate: bool = True,
) -> tuple[RequestAdapter, ...]:
    """``lora_requests`` + ``lora_scales`` (the public list form) as validated :class:`RequestAdapter`.

    Args:
        lora_requests: list or tuple of ``LoRARequest``.
        lora_scales: ``None`` / empty (every scale takes its default), or one entry per adapter: a
            number, a per-step list, or a schedule (:class:`LoRAScaleSchedule` or its dict form).
        max_loras, num_steps: see :func:`validate_request_adapters`.
        validate: ``False`` only pairs the lists (their shape is still checked) and leaves the list
            rules to the caller (the request converter checks each stage's adapters once).

    Raises:
        InvalidRequestError: not lists, unequal lengths, or a rule of :func:`validate_request_adapters`.
    """
    lora_scales = [] if lora_scales is None else lora_scales
    if not isinstance(lora_requests, list | tuple):
        raise InvalidRequestError(
            f"lora_requests must be a list of LoRARequest, got {type(lora_requests).__name__}"
        )
    if not isinstance(lora_scales, list | tuple):
        raise InvalidRequestError(
            f"lora_scales must be a list (one scale or schedule per adapter), got {type(lora_scales).__name__}"
        )
    if lora_scales and len(lora_scales) != len(lora_requests):
        raise InvalidRequestError(
            f"lora_scales must be empty or have one entry per lora_requests entry "
            f"({len(lora_requests)}), got {len(lora_scales)}"
        )
    scales = list(lora_scales) or [None] * len(lora_requests)
    paired = tuple(RequestAdapter(r, s) for r, s in zip(lora_requests, scales, strict=True))
    if not validate:
        return paired
    return validate_request_adapters(paired, max_loras, num_steps=num_steps)


def gather_request_adapters(
    params_loras: tuple[Sequence[LoRARequest], Sequence[float]] = ((), ()),
    lora_request: LoRARequest | None = None,
    lora_scale: float | None = None,
    lora_requests: Sequence[LoRARequest] | None = None,
    lora_scales: Sequence[float] | None = None,
    max_loras: int | None = None,
    *,
    validate: bool = True,
) -> tuple[RequestAdapter, ...]:
    """One request's adapters from whichever public shape carried them.

    Args:
        params_loras: ``(lora_requests, lora_scales)`` of ``OmniDiffusionSamplingParams``.
        lora_request / lora_scale: one adapter and its scale (``generate`` convenience).
        lora_requests / lora_scales: several composed adapters (``generate`` convenience).
        max_loras: see :func:`validate_request_adapters`.
        validate: see :func:`to_request_adapters`.

    Raises:
        InvalidRequestError: adapters given in two places, ``lora_request`` together with
            ``lora_requests``, a scale without an adapter, or a list rule.
    """
    given = [lora_request is not None, bool(lora_requests), bool(params_loras[0])]
    if sum(given) > 1:
        raise InvalidRequestError(
            "pass a request's adapters in one place: lora_request (one adapter), lora_requests (a list) "
            "or OmniDiffusionSamplingParams.lora_requests"
        )
    if lora_scale is not None and lora_request is None:
        raise InvalidRequestError("lora_scale needs lora_request (use lora_scales with lora_requests)")
    if lora_scales and not lora_requests:
        raise InvalidRequestError("lora_scales needs lora_requests")
    requests: Sequence[LoRARequest]
    scales: Sequence[float] | None
    if lora_request is not None:
        requests, scales = [lora_request], None if lora_scale is None else [lora_scale]
    elif lora_requests:
        requests, scales = lora_requests, lora_scales
    else:
        requests, scales = params_loras
    return to_request_adapters(requests, scales, max_loras, validate=validate)
