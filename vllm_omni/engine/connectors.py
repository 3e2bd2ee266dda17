"""Tensors handed from one stage to the next.

A stage whose successor needs more than text (Qwen2.5-Omni's thinker hands the talker its
hidden states; the talker hands code2wav its codec tokens) returns a :class:`StagePayload`
next to its usual output. The orchestrator moves it to the next stage through a
:class:`StageConnector`; the next stage's input processor reads the tensors by name.

Payloads hold plain CPU tensors and picklable metadata only, so that a connector between
stage processes can ship them through shared memory unchanged. :class:`InProcessConnector`
(stages in one process, today's runtime) hands the same object over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from vllm_omni.errors import StageEngineError


@dataclass
class StagePayload:
    """Named tensors (and small metadata) one stage hands the next for one request.

    Attributes:
        tensors: name -> CPU tensor, e.g. ``"hidden_states"`` float32 ``[T, H]``,
            ``"token_ids"`` int64 ``[T]``; each producer documents its names, shapes and dtypes.
        meta: picklable scalars / strings / lists (e.g. the voice of a request).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def tensor(self, name: str, *, consumer: str) -> torch.Tensor:
        """The tensor ``name``.

        Raises:
            StageEngineError: the producer did not hand it over (names the consumer and the tensor).
        """
        try:
            return self.tensors[name]
        except KeyError:
            raise StageEngineError(
                f"{consumer}: the previous stage handed no {name!r} tensor (it has {sorted(self.tensors)})"
            ) from None

    def check(self, producer: str) -> StagePayload:
        """``self`` after checking every tensor is a plain CPU tensor that needs no grad.

        Raises:
            StageEngineError: naming the producer and the offending tensor.
        """
        for name, value in self.tensors.items():
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.requires_grad:
                raise StageEngineError(
                    f"{producer}: payload tensor {name!r} must be a CPU tensor without grad, got "
                    f"{type(value).__name__} on {getattr(value, 'device', None)}"
                )
        return self


@runtime_checkable
class StageConnector(Protocol):
    """Moves a :class:`StagePayload` from one stage to the next."""

    def send(self, payload: StagePayload) -> Any:
        """Hand ``payload`` over; returns the handle :meth:`receive` takes."""
        ...

    def receive(self, handle: Any) -> StagePayload:
        """The payload a :meth:`send` returned ``handle`` for (once)."""
        ...


class InProcessConnector:
    """Stages in one process: the handle is the (checked) payload itself; nothing is copied."""

    def __init__(self, producer: str = "stage"):
        self.producer = producer

    def send(self, payload: StagePayload) -> StagePayload:
        return payload.check(self.producer)

    def receive(self, handle: StagePayload) -> StagePayload:
        return handle
