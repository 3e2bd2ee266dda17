"""What a stage's adapters were, replayed into a fresh runtime after its worker restarts.

Under ``Omni`` / ``AsyncOmni`` the engine's adapter registry says what a stage must hold
(:meth:`~vllm_omni.engine.workers.supervisor.SupervisedStageRuntime.attach_adapter_owner`) and the
journal is not kept; it serves a supervised runtime used on its own. Both worker backends (``mp``, ``ray``) record every successful ``add_lora`` /
``remove_lora`` / ``pin_lora`` call made on a stage; when the stage's worker is replaced, the
journal re-adds the adapters that were added at run time (in the order they were first added)
and re-pins the pinned ones, so ``list_loras()`` answers what it did before. Adapters a stage
loads at start-up come back with the stage itself; adapters an LLM stage loaded for requests
(not through ``add_lora``) are loaded again by the next request that names them.

A replay restores what it can: an adapter that fails to load again (its files deleted or
unreadable) is returned with its error and the others are restored
(:class:`~vllm_omni.engine.workers.supervisor.SupervisedStageRuntime` marks it failed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from vllm_omni.errors import AdapterFileNotAllowedError, StageDeadError
from vllm_omni.lora.allow_list import RefusedRestore
from vllm_omni.lora.request import LoRARequest


class LoRAJournal:
    """The net effect of a stage's LoRA management calls (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._added: dict[int, LoRARequest] = {}  # insertion order: first add
        self._pinned: set[int] = set()

    def record(self, method: str, args: tuple[Any, ...]) -> None:
        """Note a call that succeeded on the stage (other methods are ignored).

        Args:
            method: ``"add_lora"`` (``args``: ``(LoRARequest,)``), ``"remove_lora"`` or
                ``"pin_lora"`` (``args``: ``(lora_int_id,)``).
        """
        with self._lock:
            if method == "add_lora":
                request = args[0]
                self._added.setdefault(request.lora_int_id, request)
            elif method == "remove_lora":
                self._added.pop(args[0], None)
                self._pinned.discard(args[0])
            elif method == "pin_lora":
                self._pinned.add(args[0])

    def entries(self) -> tuple[list[LoRARequest], list[int]]:
        """``(adapters added at run time, ids pinned)`` as recorded."""
        with self._lock:
            return list(self._added.values()), sorted(self._pinned)

    def request(self, lora_int_id: int) -> LoRARequest | None:
        """The recorded ``add_lora`` request of an adapter (``None`` when not recorded)."""
        with self._lock:
            return self._added.get(lora_int_id)

    def replay(self, call: Callable[..., Any]) -> dict[int, BaseException]:
        """Re-add the recorded adapters, then re-pin the pinned ones; restore what can be.

        Args:
            call: ``call(method, *args)`` runs one LoRA method on the fresh runtime.

        Returns:
            ``{lora_int_id: error}`` of the adapters that could not be added (or pinned) again;
            ``{}`` when everything was restored.

        Raises:
            StageDeadError: the fresh runtime died meanwhile (the restart itself failed).
        """
        return replay_adapters(*self.entries(), call)


def replay_adapters(
    added: list[LoRARequest], pinned: list[int], call: Callable[..., Any]
) -> dict[int, BaseException]:
    """Add ``added`` (in order), then pin ``pinned``, through ``call(method, *args)``; restore what can be.

    Returns:
        ``{lora_int_id: error}`` of the adapters that could not be added (or pinned) again.

    Raises:
        StageDeadError: the fresh runtime died meanwhile (the restart itself failed).
    """
    failed: dict[int, BaseException] = {}
    for request in added:
        if isinstance(request, RefusedRestore):  # its files may not be read now: not loaded
            failed[request.lora_int_id] = AdapterFileNotAllowedError(request.refusal)
            continue
        _try(call, failed, request.lora_int_id, "add_lora", request)
    for lora_int_id in pinned:
        if lora_int_id not in failed:
            _try(call, failed, lora_int_id, "pin_lora", lora_int_id)
    return failed


def _try(call: Callable[..., Any], failed: dict[int, BaseException], lora_int_id: int, *args: Any) -> None:
    try:
        call(*args)
    except StageDeadError:
        raise
    except Exception as exc:  # this adapter only: the others are still restored
        failed[lora_int_id] = exc
