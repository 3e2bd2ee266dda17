"""What crosses a process boundary of ours: payloads, errors, and the call / reply messages.

One set of helpers for every worker we start: a stage's ``mp`` worker
(:mod:`vllm_omni.engine.workers.protocol` adds its request messages), a stage's Ray actor
(:mod:`vllm_omni.engine.workers.ray_actor`) and the tensor-parallel ranks of the diffusion
engine (:mod:`vllm_omni.diffusion.engine`). It sits low (it imports only ``msgspec`` and
:mod:`vllm_omni.errors`) so that every layer may use it.

- Payloads: :func:`dump` / :func:`load`: pickled with torch's ``ForkingPickler`` (a CPU tensor
  moves to shared memory and only its handle crosses).
- Errors: :func:`dump_error` / :func:`load_error`: the exception with its class and message
  (and, as a note, the traceback where it was raised); one that cannot cross intact becomes a
  :class:`~vllm_omni.errors.StageEngineError` naming its class. Over Ray, where values are
  pickled by Ray, a failure is returned as :class:`RemoteFailure` and :func:`unwrap` raises it.
- Messages: msgspec structs of a tagged union (``{"type": "call", ...}``, msgpack), one frame per
  message (:func:`encode`, :func:`decoder`): :class:`Call` / :class:`CallResult`,
  :class:`Ready`, :class:`Failed`, :class:`Shutdown`.
"""

from __future__ import annotations

import io
import pickle
import traceback
from typing import Any

import msgspec

from vllm_omni.errors import StageEngineError


class Call(msgspec.Struct, tag="call"):
    """Run method ``method`` (``payload``: pickled ``(args, kwargs)``); answered by :class:`CallResult`."""

    cid: int
    method: str
    payload: bytes


class CallResult(msgspec.Struct, tag="call_result"):
    """Answer of :class:`Call` ``cid``: ``payload`` is the pickled result, or the error (:func:`dump_error`) when not ``ok``."""

    cid: int
    ok: bool
    payload: bytes


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Shut down within ``timeout`` seconds (``None``: the receiver's own bound) and exit."""

    timeout: float | None = None


class Ready(msgspec.Struct, tag="ready"):
    """The worker started in process ``pid``, whose torch intra-op pool has ``torch_threads``
    threads (``torch.get_num_threads()`` once started; 0: unknown); ``preloaded``: vLLM was
    already imported when the worker began (forked from a preloaded interpreter)."""

    pid: int
    torch_threads: int = 0
    preloaded: bool = False


class Failed(msgspec.Struct, tag="failed"):
    """Request ``rid`` failed (``rid`` -1: the worker failed to start); ``error``: :func:`dump_error`."""

    rid: int
    error: bytes


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """One message as a msgpack frame."""
    return _encoder.encode(msg)


def decoder(union: Any) -> msgspec.msgpack.Decoder:
    """A decoder of frames holding one message of ``union`` (a ``|`` of tagged structs)."""
    return msgspec.msgpack.Decoder(union)


def dump(obj: Any) -> bytes:
    """``obj`` pickled with torch's ``ForkingPickler`` (CPU tensors through shared memory)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reducers; torch loads lazily here)

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def load(data: bytes) -> Any:
    """The object :func:`dump` pickled."""
    import torch.multiprocessing  # noqa: F401  (tensor rebuild functions; torch loads lazily here)

    return pickle.loads(data)


def dump_error(exc: BaseException, where: str | None = None) -> bytes:
    """``exc`` pickled with its class (``vllm_omni.errors`` classes survive, message included).

    Args:
        exc: the exception to send.
        where: e.g. ``"stage 0 worker"``; when given, the traceback is attached to ``exc`` as a
            note (``raised in <where>:``), which crosses with it.

    An exception that does not survive a pickle round trip (unpicklable arguments, a custom
    ``__init__``) crosses as a :class:`~vllm_omni.errors.StageEngineError` naming its class.
    """
    if where is not None and exc.__traceback__ is not None:
        text = "".join(traceback.format_exception(exc))
        exc.add_note(f"raised in {where}:\n{text}")
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


class RemoteFailure:
    """A failure returned as a value (where the transport pickles values itself, e.g. Ray):
    ``data`` is :func:`dump_error` of the exception."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteFailure, (self.data,))

    @classmethod
    def of(cls, exc: BaseException, where: str | None = None) -> RemoteFailure:
        return cls(dump_error(exc, where))


def unwrap(value: Any) -> Any:
    """``value``, or the exception a :class:`RemoteFailure` carries raised here (same class)."""
    if isinstance(value, RemoteFailure):
        raise load_error(value.data)
    return value
