"""The messages between the orchestrator's process and a stage worker (``worker_backend="mp"``).

Each message is a msgspec ``Struct`` of a tagged union (``{"type": "submit", ...}`` on the
wire, msgpack-encoded), sent as one frame over a ``multiprocessing`` pipe. Python objects
(prompts, ``SamplingParams``, ``RequestOutput``, PIL images, tensors, exceptions) travel as
bytes pickled with torch's ``ForkingPickler``: a CPU tensor is moved to shared memory and only
its handle crosses the pipe. The generic messages (:class:`Call`, :class:`CallResult`,
:class:`Ready`, :class:`Failed`, :class:`Shutdown`) and the payload / error helpers
(:func:`dump`, :func:`load`, :func:`dump_error`, :func:`load_error`) are those of
:mod:`vllm_omni.ipc`, shared with the Ray actor and the diffusion ranks.

To the worker: :class:`Submit`, :class:`Abort`, :class:`Call`, :class:`Hold`, :class:`Release`,
:class:`Shutdown`. From the worker: :class:`Ready`, :class:`Accepted`, :class:`Output`,
:class:`Partial`, :class:`Failed`, :class:`CallResult`.
"""

from __future__ import annotations

import msgspec

from vllm_omni.ipc import (
    Call,
    CallResult,
    Failed,
    Ready,
    Shutdown,
    decoder,
    dump,
    dump_error,
    encode,
    load,
    load_error,
)

__all__ = [
    "Abort",
    "Accepted",
    "Call",
    "CallResult",
    "Failed",
    "Hold",
    "Output",
    "Partial",
    "Ready",
    "Release",
    "Shutdown",
    "Submit",
    "decode_from_worker",
    "decode_to_worker",
    "dump",
    "dump_error",
    "encode",
    "load",
    "load_error",
]


class Submit(msgspec.Struct, tag="submit"):
    """Queue one request (``payload``: pickled ``(prompt, params, kwargs)``); ``stream``: send partials."""

    rid: int
    payload: bytes
    stream: bool = False


class Abort(msgspec.Struct, tag="abort"):
    """Cancel request ``rid`` (an LLM stage aborts it at its next step)."""

    rid: int


class Hold(msgspec.Struct, tag="hold"):
    """Enter one ``runtime.hold()`` block (requests submitted until :class:`Release` start together)."""


class Release(msgspec.Struct, tag="release"):
    """Leave the innermost ``runtime.hold()`` block."""


class Accepted(msgspec.Struct, tag="accepted"):
    """Request ``rid`` passed ``submit``'s checks and is queued."""

    rid: int


class Output(msgspec.Struct, tag="output"):
    """Request ``rid`` finished (``payload``: its pickled output)."""

    rid: int
    payload: bytes


class Partial(msgspec.Struct, tag="partial"):
    """One streamed piece of request ``rid`` (``payload``: a pickled DELTA ``RequestOutput``)."""

    rid: int
    payload: bytes


ToWorker = Submit | Abort | Call | Hold | Release | Shutdown
FromWorker = Ready | Accepted | Output | Partial | Failed | CallResult

_to_worker_decoder = decoder(ToWorker)
_from_worker_decoder = decoder(FromWorker)


def decode_to_worker(frame: bytes) -> ToWorker:
    return _to_worker_decoder.decode(frame)


def decode_from_worker(frame: bytes) -> FromWorker:
    return _from_worker_decoder.decode(frame)
