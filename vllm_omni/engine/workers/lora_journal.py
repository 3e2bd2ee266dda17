"""What a stage's adapters were, replayed into a fresh runtime after its worker restarts.

Both worker backends (``mp``, ``ray``) record every successful ``add_lora`` /
``remove_lora`` / ``pin_lora`` call made on a stage; when the stage's worker is replaced, the
journal re-adds the adapters that were added at run time (in the order they were first added)
and re-pins the pinned ones, so ``list_loras()`` answers what it did before. Adapters a stage
loads at start-up come back with the stage itself; adapters an LLM stage loaded for requests
(not through ``add_lora``) are loaded again by the next request that names them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

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

    def replay(self, call: Callable[..., Any]) -> None:
        """Re-add the recorded adapters, then re-pin the pinned ones.

        Args:
            call: ``call(method, *args)`` runs one LoRA method on the fresh runtime; its
                errors propagate (the caller decides whether the restart failed).
        """
        added, pinned = self.entries()
        for request in added:
            call("add_lora", request)
        for lora_int_id in pinned:
            call("pin_lora", lora_int_id)
