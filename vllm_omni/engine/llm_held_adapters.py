"""What an LLM stage holds for its adapters besides vLLM's caches, and in-place updates of pinned ones.

* Adapter folders are handed to vLLM as the bytes the stage's validator read and checked
  (:func:`~vllm_omni.engine.tensor_lora.held_form`), never as files: a folder rewritten in place never
  reaches a loaded version, and vLLM maps no file a user may rewrite. The bytes of at most
  :data:`HELD_EVICTED` folders vLLM evicted are kept; one let go is read again when used again and
  served only if its fingerprint is still the version's.
* A new version of a pinned adapter that finds every entry pinned (``max_loras=1, max_cpu_loras=1``, the
  RL rollout set-up) is swapped into the old version's place once no running request uses the old one.

:class:`HeldAdapters` is a part of :class:`~vllm_omni.engine.llm_stage.LLMStageEngine` (its methods run on
the stage's driver thread unless said otherwise).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from vllm_omni.engine import tensor_lora
from vllm_omni.engine.vllm_adapter_names import vllm_lora_request
from vllm_omni.errors import InvalidAdapterError, LoRACacheError
from vllm_omni.lora.request import LoRARequest
from vllm_omni.lora.tensor_request import TensorLoRARequest

#: Adapter folders vLLM evicted whose bytes an LLM stage keeps (it loads them again from these bytes, whatever
#: happened to the files); beyond that it keeps their fingerprint only and reads the files again.
HELD_EVICTED = 8


class HeldAdapters:
    """The adapter-holding part of an LLM stage (see the module docstring)."""

    # provided by LLMStageEngine
    _engine: Any
    _cv: Any
    _queue: Any
    _lora_names: dict[int, str]
    validator: Any
    stage: Any
    recorder: Any
    _ids_in_use: Any
    _loaded_ids: Any
    _load_adapter: Any

    def _init_held(self) -> None:
        #: adapter folders read by the validator, in their in-memory form ({lora_int_id: form}): vLLM
        #: loads these bytes, never the files (see :func:`~vllm_omni.engine.tensor_lora.held_form`)
        self._held_files: dict[int, LoRARequest] = {}
        #: folders whose bytes were let go after vLLM evicted them (``_held_files`` keeps at most
        #: ``HELD_EVICTED`` evicted ones): {lora_int_id: fingerprint}; loaded again only from files that
        #: still have it
        self._let_go: dict[int, str] = {}
        #: the request each adapter in the engine was loaded from: a swap puts it back
        self._engine_requests: dict[int, LoRARequest] = {}
        #: pending in-place updates of a pinned adapter: {old id: (new version, future)}
        self._swaps: dict[int, tuple[LoRARequest, Future]] = {}

    def _hold_again(self, lora: LoRARequest) -> None:
        """Before vLLM loads a folder whose bytes this stage let go: read it again, and refuse it unless
        it is still the version the id was validated with (driver thread).

        Raises:
            InvalidAdapterError: the files changed (or are unreadable) since; the new version gets a new
                id from the adapter registry on the next request.
        """
        expected = self._let_go.get(lora.lora_int_id)
        if expected is None or isinstance(lora, TensorLoRARequest):
            return
        content = self.validator.read_again(lora)
        if content.sha256 != expected:
            raise InvalidAdapterError(
                f"{self.stage.label}: adapter {lora.lora_name!r} (id {lora.lora_int_id}, path {lora.lora_path!r}) "
                f"was evicted and its files changed since this version was loaded (content {expected[:12]} -> "
                f"{content.sha256[:12]}); send the request again to get the new version"
            )
        held = tensor_lora.held_form(lora, content)
        tensor_lora.remember(held, self, self.stage.label)
        self._held_files[lora.lora_int_id] = held
        del self._let_go[lora.lora_int_id]

    def _let_go_of_evicted(self, in_engine: set[int]) -> None:
        """Keep the bytes of at most ``HELD_EVICTED`` folders vLLM evicted (the oldest go first; their
        fingerprints stay, see ``_hold_again``), so that request-time adapters do not accumulate."""
        in_use = self._ids_in_use()  # vLLM loads a running request's evicted adapter again by itself
        evicted = [i for i in self._held_files if i not in in_engine and i not in in_use]
        for lora_int_id in evicted[: max(0, len(evicted) - HELD_EVICTED)]:
            held = self._held_files.pop(lora_int_id)
            tensor_lora.forget(lora_int_id, self)
            self._let_go[lora_int_id] = held.content_sha256

    def _vllm_form(self, lora: LoRARequest) -> LoRARequest:
        """What vLLM is handed for ``lora``: its held bytes for a folder (``_held_files``), named per version."""
        return vllm_lora_request(self._held_files.get(lora.lora_int_id, lora))

    def _forget(self, lora_int_id: int) -> None:
        """Drop what this stage holds for ``lora_int_id`` outside the engine (driver thread)."""
        tensor_lora.forget(lora_int_id, self)
        self._held_files.pop(lora_int_id, None)
        self._let_go.pop(lora_int_id, None)
        self._engine_requests.pop(lora_int_id, None)

    def _load_or_swap(self, lora: LoRARequest) -> bool | Future:
        """``_load_adapter``, or, with no room, the pending swap of another version of a pinned adapter
        of the same name (driver thread): a future of its result."""
        loaded = self._loaded_ids()
        try:
            return self._load_adapter(lora, loaded)
        except LoRACacheError:
            old = next(
                (
                    i
                    for i in sorted(loaded)
                    if i != lora.lora_int_id and self._lora_names.get(i) == lora.lora_name
                ),
                None,
            )
            if old is None or old in self._swaps or old not in self._engine_requests:
                raise
        done: Future = Future()
        self._swaps[old] = (lora, done)
        self._try_swaps()
        return done

    def _try_swaps(self) -> None:
        """Run the pending swaps whose old version no running request uses any more (driver thread)."""
        for old in [i for i in self._swaps if i not in self._ids_in_use()]:
            new, done = self._swaps.pop(old)
            try:
                done.set_result(self._swap_in(old, new))
            except Exception as exc:
                done.set_exception(exc)

    def _swap_in(self, old: int, new: LoRARequest) -> bool:
        """Replace adapter ``old`` (pinned, unused) by ``new`` in the engine, pinned; queued requests of
        ``old`` are bound to ``new``. If ``new`` fails to load, ``old`` is loaded and pinned again."""
        previous = self._engine_requests[old]
        self._engine.remove_lora(old)
        try:
            added = self._load_adapter(new, self._loaded_ids())
            self._engine.pin_lora(new.lora_int_id)
        except Exception:
            self._engine.remove_lora(new.lora_int_id)
            self._engine.add_lora(self._vllm_form(previous))
            self._engine.pin_lora(old)
            raise
        self._engine_requests.pop(old, None)
        name = self._lora_names.get(old, str(old))
        self.recorder.unloaded(name, version=old)
        self.recorder.pinned(name, new.lora_int_id)
        with self._cv:
            for item in self._queue:
                if item.lora_request is not None and item.lora_request.lora_int_id == old:
                    item.lora_request = new
        return added
