"""The messages between the orchestrator's process and a stage worker.

Each message is a msgspec ``Struct`` of a tagged union (``{"type": "submit", ...}`` on the
wire, msgpack-encoded), sent as one frame over a ``multiprocessing`` pipe. Python objects
(prompts, ``SamplingParams``, ``RequestOutput``, PIL images, tensors, exceptions) travel as
bytes pickled with torch's ``ForkingPickler``: a CPU tensor is moved to shared memory and only
its handle crosses the pipe.

To the worker: :class:`Submit`, :class:`Abort`, :class:`Call`, :class:`Hold`, :class:`Release`,
:class:`Shutdown`. From the worker: :class:`Ready`, :class:`Accepted`, :class:`Output`,
:class:`Partial`, :class:`Failed`, :class:`CallResult`.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import msgspec

from vllm_omni.errors import StageEngineError


class Submit(msgspec.Struct, tag="submit"):
    """Queue one request (``payload``: pickled ``(prompt, params, kwargs)``); ``stream``: send partials."""

    rid: int
    payload: bytes
    stream: bool = False


class Abort(msgspec.Struct, tag="abort"):
    """Cancel request ``rid`` (an LLM stage aborts it at its next step)."""

    rid: int


class Call(msgspec.Struct, tag="call"):
    """Run runtime method ``method`` (``payload``: pickled ``(args, kwargs)``); answered by :class:`CallResult`."""

    cid: int
    method: str
    payload: bytes


class Hold(msgspec.Struct, tag="hold"):
    """Enter one ``runtime.hold()`` block (requests submitted until :class:`Release` start together)."""


class Release(msgspec.Struct, tag="release"):
    """Leave the innermost ``runtime.hold()`` block."""


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Shut the runtime down within ``timeout`` seconds (``None``: its own bound) and exit."""

    timeout: float | None = None


class Ready(msgspec.Struct, tag="ready"):
    """The runtime started in process ``pid``, whose torch intra-op pool has ``torch_threads``
    threads (``torch.get_num_threads()`` after the runtime started; 0: unknown)."""

    pid: int
    torch_threads: int = 0


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


class Failed(msgspec.Struct, tag="failed"):
    """Request ``rid`` failed (``rid`` -1: the runtime failed to start); ``error``: see :func:`dump_error`."""

    rid: int
    error: bytes


class CallResult(msgspec.Struct, tag="call_result"):
    """Answer of :class:`Call` ``cid``: ``payload`` is the pickled result, or the error when not ``ok``."""

    cid: int
    ok: bool
    payload: bytes


ToWorker = Submit | Abort | Call | Hold | Release | Shutdown
FromWorker = Ready | Accepted | Output | Partial | Failed | CallResult

_to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
_from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: ToWorker | FromWorker) -> bytes:
    """One message as a msgpack frame."""
    return _encoder.encode(msg)


def decode_to_worker(frame: bytes) -> ToWorker:
    return _to_worker_decoder.decode(frame)


def decode_from_worker(frame: bytes) -> FromWorker:
    return _from_worker_decoder.decode(frame)


def dump(obj: Any) -> bytes:
    """``obj`` pickled with torch's ``ForkingPickler`` (CPU tensors through shared memory)."""
    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reducers)

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def load(data: bytes) -> Any:
    """The object :func:`dump` pickled."""
    import torch.multiprocessing  # noqa: F401

    return pickle.loads(data)


def dump_error(exc: BaseException) -> bytes:
    """``exc`` pickled with its class (``vllm_omni.errors`` classes survive, message included).

    An exception that does not survive a pickle round trip (unpicklable arguments, a custom
    ``__init__``) crosses as a :class:`~vllm_omni.errors.StageEngineError` naming its class.
    """
    try:
        data = pickle.dumps(exc, pickle.HIGHEST_PROTOCOL)
        back = pickle.loads(data)
        if type(back) is type(exc) and str(back) == str(exc):
            return data
    except Exception:
        pass
    return pickle.dumps(StageEngineError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"))


def load_error(data: bytes) -> BaseException:
    """The exception :func:`dump_error` pickled."""
    return pickle.loads(data)
