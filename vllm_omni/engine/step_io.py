"""Per-request model inputs and outputs at every engine step, which vLLM 0.32 has no field for.

Two things a multi-stage Omni model needs from one vLLM request:

- **a stream in** (the talker): at decode step ``k`` the model's input embedding is the sampled
  token's embedding plus row ``k`` of a per-request tensor (the thinker's reply, projected). vLLM
  feeds a model token ids (or ``prompt_embeds`` for the prompt) and nothing per request and step,
  so a reply used to cost one engine request per token.
- **hidden states out** (the thinker): the final hidden state of every position the request
  computed, from the engine's own pass. vLLM returns sampled tokens and log-probabilities only,
  so a second copy of the thinker used to recompute them.

How. A request carries a key in ``SamplingParams.extra_args`` (:data:`EXTRA_ARGS_KEY`, the field
vLLM keeps for plugins). The stage's engine runs with this package's worker
(``worker_cls``, :data:`CPU_WORKER` / :data:`GPU_WORKER`), whose model runner wraps vLLM's
``_model_forward`` (the method vLLM documents for subclasses): before the forward it adds each
keyed request's stream rows to its tokens' input embeddings, after it copies each keyed request's
hidden states out (:mod:`vllm_omni.engine.step_io_worker`). Token ``j`` of a request scheduled
with ``num_computed_tokens = c`` sits at sequence position ``c + j``.

The per-request data lives in this module's table (:func:`open_entry` / :func:`close_entry`),
shared by the stage and its model runner, so the runner must run in the stage's process: vLLM's
engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, this project's default) and one
rank (``tensor_parallel_size=1``, ``pipeline_parallel_size=1``). :func:`check_in_process` refuses
anything else at start-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import torch

from vllm_omni.errors import ConfigError, InvalidRequestError, StageEngineError

#: the ``SamplingParams.extra_args`` key that names a request's entry in this module's table
EXTRA_ARGS_KEY = "vllm_omni_step_io"
#: ``worker_cls`` values (vLLM's ``EngineArgs.worker_cls``) of the stepping worker, by platform
CPU_WORKER = "vllm_omni.engine.step_io_worker.StepIOCPUWorker"
GPU_WORKER = "vllm_omni.engine.step_io_worker.StepIOGPUWorker"
#: ``EngineArgs.additional_config`` key: decoder layer counts whose output the stepping worker
#: captures too (vLLM's ``SupportsEagle3.set_aux_hidden_state_layers``, set once at load)
AUX_LAYERS_KEY = "vllm_omni_capture_layers"


@dataclasses.dataclass
class StepIOEntry:
    """One request's per-step inputs and outputs.

    Attributes:
        stream: rows added to the input embeddings of positions ``stream_start + k`` (row ``k``;
            the last row once exhausted), ``[R, H]`` in any float dtype (cast to the embeddings');
            ``None``: nothing added.
        stream_start: the first position that gets a row (the prompt's length for a decode stream).
        capture: copy the final hidden states of every computed position out.
        captured: ``(start position, float32 [n, H])`` pieces in compute order (chunked prefill,
            decode steps, a recomputation after preemption), assembled by :func:`hidden_states`.
        captured_layer: the same for the layer the engine was started to return
            (:data:`AUX_LAYERS_KEY`): the residual stream after that many decoder layers,
            transformers' ``hidden_states[layer]``.
    """

    stream: torch.Tensor | None = None
    stream_start: int = 0
    capture: bool = False
    captured: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)
    captured_layer: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)


_LOCK = threading.Lock()
_ENTRIES: dict[str, StepIOEntry] = {}


def open_entry(entry: StepIOEntry) -> str:
    """Register ``entry``; the key to put in ``extra_args[EXTRA_ARGS_KEY]``."""
    key = uuid.uuid4().hex
    with _LOCK:
        _ENTRIES[key] = entry
    return key


def close_entry(key: str) -> StepIOEntry | None:
    """Drop the entry of ``key`` (the request finished, failed or was cancelled); it, if known."""
    with _LOCK:
        return _ENTRIES.pop(key, None)


def lookup(extra_args: dict[str, Any] | None) -> StepIOEntry | None:
    """The entry a request's ``extra_args`` name (model-runner side); ``None`` for other requests."""
    if not isinstance(extra_args, dict):  # runs inside the engine step: never raise on a request's value
        return None
    key = extra_args.get(EXTRA_ARGS_KEY)
    if not isinstance(key, str):
        return None
    with _LOCK:
        return _ENTRIES.get(key)


def with_entry(params: Any, key: str, *, label: str = "", skip_prefix_cache: bool = False) -> Any:
    """A clone of ``params`` (``SamplingParams``) naming entry ``key``; ``skip_prefix_cache``: the
    request computes its whole prompt (a prefix-cache hit would compute, and capture, nothing there).

    Raises:
        InvalidRequestError: :func:`check_extra_args`.
    """
    check_extra_args(params, label)
    params = params.clone()
    params.extra_args = {**(params.extra_args or {}), EXTRA_ARGS_KEY: key}
    if skip_prefix_cache:
        params.skip_reading_prefix_cache = True
    return params


def submit_keyed(
    entry: StepIOEntry,
    enqueue: Callable[[str], Future],
    finish: Callable[[Any, StepIOEntry], Any],
) -> Future:
    """One engine request that carries ``entry``: the life of the entry around it.

    ``entry`` is registered, ``enqueue(key)`` queues the request (its params through
    :func:`with_entry`) and returns the engine's future; the entry is dropped when that future is done,
    whatever the outcome. The returned future resolves to ``finish(engine output, entry)``, or fails
    with the engine's or ``finish``'s error; cancelling it cancels the engine request.

    Raises:
        whatever ``enqueue`` raises (the entry is dropped first).
    """
    key = open_entry(entry)
    try:
        inner = enqueue(key)
    except BaseException:
        close_entry(key)
        raise
    outer: Future = Future()
    outer.add_done_callback(lambda f: f.cancelled() and inner.cancel())

    def done(f: Future) -> None:
        close_entry(key)
        if outer.done():
            return
        if f.cancelled():
            outer.cancel()
            return
        try:
            result = finish(f.result(), entry)
        except Exception as exc:
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                outer.set_exception(exc)
            return
        with contextlib.suppress(InvalidStateError):
            outer.set_result(result)

    inner.add_done_callback(done)
    return outer


def check_extra_args(params: Any, label: str) -> None:
    """Refuse ``SamplingParams.extra_args`` that is not a dict, or that sets this module's reserved key
    (:data:`EXTRA_ARGS_KEY`), naming ``label`` (the stage) and the field.

    Raises:
        InvalidRequestError: as above.
    """
    extra = getattr(params, "extra_args", None)
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise InvalidRequestError(
            f"{label}: SamplingParams.extra_args must be a dict, got {type(extra).__name__}"
        )
    if EXTRA_ARGS_KEY in extra:
        raise InvalidRequestError(
            f"{label}: SamplingParams.extra_args[{EXTRA_ARGS_KEY!r}] is reserved for vllm_omni"
        )


def hidden_states(entry: StepIOEntry, length: int, label: str, *, layer: bool = False) -> torch.Tensor:
    """The captured hidden states of positions ``0 .. length - 1``, float32 ``[length, H]``: the final
    ones, or with ``layer`` those of the engine's capture layer (:data:`AUX_LAYERS_KEY`).

    A later piece overwrites an earlier one at the same positions (a preempted request computes
    them again).

    Raises:
        StageEngineError: a position in that range was never computed (naming ``label``).
    """
    pieces = entry.captured_layer if layer else entry.captured
    if not pieces:
        raise StageEngineError(f"{label}: the engine computed no position of the request (no hidden states)")
    width = pieces[0][1].shape[1]
    out = torch.empty(length, width, dtype=torch.float32)
    seen = torch.zeros(length, dtype=torch.bool)
    for start, rows in pieces:
        stop = min(start + rows.shape[0], length)
        if stop > start:
            out[start:stop] = rows[: stop - start]
            seen[start:stop] = True
    if not bool(seen.all()):
        missing = int((~seen).nonzero()[0])
        raise StageEngineError(
            f"{label}: no hidden state was computed for position {missing} of {length} "
            "(the engine skipped it: prefix cache or speculative decoding)"
        )
    return out


def check_in_process(stage: Any, option: str, capture_layer: int | None = None) -> dict[str, Any]:
    """``stage``'s options with the stepping worker as ``worker_cls`` (and, with ``capture_layer``,
    that layer in ``additional_config[AUX_LAYERS_KEY]``); ``option`` names the feature in the errors.

    Raises:
        ConfigError: the stage sets its own ``worker_cls``, runs more than one rank or engine (tensor,
            pipeline or data parallel), uses speculative decoding, or vLLM's engine core runs in another
            process (``VLLM_ENABLE_V1_MULTIPROCESSING`` true), naming the stage and the option.
    """
    opts = dict(stage.options)
    if opts.get("worker_cls") not in (None, "auto", CPU_WORKER, GPU_WORKER):
        raise ConfigError(
            f"{stage.label}: {option} runs the engine with vllm_omni's worker; the stage's worker_cls "
            f"{opts['worker_cls']!r} cannot be combined with it",
            options=("worker_cls",),
        )
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if int(opts.get(name) or 1) != 1:
            raise ConfigError(
                f"{stage.label}: {option} needs the model runner in the stage's process; {name} must be 1",
                options=(name,),
            )
    if opts.get("speculative_config"):  # draft steps compute positions the table does not see
        raise ConfigError(
            f"{stage.label}: {option} places a row per computed position, which speculative decoding's draft "
            "and rejected tokens break; remove speculative_config from this stage",
            options=("speculative_config",),
        )
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0").strip().lower() not in ("0", "false", ""):
        raise ConfigError(
            f"{stage.label}: {option} needs vLLM's engine core in the stage's process; unset "
            "VLLM_ENABLE_V1_MULTIPROCESSING (vllm_omni sets it to 0 by default)",
            options=("VLLM_ENABLE_V1_MULTIPROCESSING",),
        )
    from vllm.platforms import current_platform

    opts["worker_cls"] = CPU_WORKER if current_platform.is_cpu() else GPU_WORKER
    if capture_layer is not None:
        opts["additional_config"] = {**(opts.get("additional_config") or {}), AUX_LAYERS_KEY: [capture_layer]}
    return opts
