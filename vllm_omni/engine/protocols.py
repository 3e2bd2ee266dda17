"""The contract of a stage runtime: what the :class:`~vllm_omni.engine.orchestrator.Orchestrator`
and the entry points call on every stage, LLM or diffusion.

Both runtimes (:class:`~vllm_omni.engine.llm_stage.LLMStageEngine`,
:class:`~vllm_omni.engine.diffusion_stage.DiffusionStageEngine`) implement it on top of
:class:`~vllm_omni.engine.stage_driver.StageDriver`: every call is thread-safe and the
engine itself is only touched by the stage's driver thread.
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from vllm_omni.config.stage_config import BaseVllmOmniStageConfig
    from vllm_omni.lora.request import LoRARequest
    from vllm_omni.stats import StageStats

#: The LoRA management calls the orchestrator fans out to stages (``Orchestrator.lora_call``).
LoRAMethod = Literal["add_lora", "remove_lora", "list_loras", "pin_lora"]


@runtime_checkable
class StageRuntime(Protocol):
    """One running stage of a pipeline.

    Attributes:
        stage: the resolved config of the stage (its ``label`` names it in errors).
    """

    stage: BaseVllmOmniStageConfig

    def submit(self, prompt: Any, params: Any, lora_request: LoRARequest | None = None) -> Future:
        """Queue one request; the future resolves to the stage's output (a vLLM ``RequestOutput``
        or a ``DiffusionOutput``). The entry stage may take extra keyword arguments; an LLM
        stage takes ``on_partial`` (streaming: called with each step's DELTA output).

        Raises (synchronously): ``OmniUserError`` subclasses for a bad request,
        ``StageEngineError`` when the stage is shut down or dead.
        """
        ...

    def validate_request(
        self, prompt: Any, params: Any, lora_request: LoRARequest | None = None, **kwargs: Any
    ) -> None:
        """Every check of :meth:`submit`, queueing nothing (same arguments, same errors)."""
        ...

    def prepare_params(self, params: Any) -> Any:
        """``params`` made ready once for many :meth:`submit` calls (identity when nothing to do)."""
        ...

    def hold(self) -> AbstractContextManager[None]:
        """Requests submitted inside the block start together when it exits."""
        ...

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter; ``True`` if newly loaded. ``LoRANotEnabledError`` without LoRA."""
        ...

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter; ``False`` if it was not loaded."""
        ...

    def list_loras(self) -> set[int]:
        """Ids of the loaded adapters."""
        ...

    def pin_lora(self, lora_int_id: int) -> bool:
        """Never evict this loaded adapter."""
        ...

    def stats(self) -> StageStats:
        """A snapshot of the stage's statistics (plain data; see :mod:`vllm_omni.stats`), without
        waiting for a running step or batch."""
        ...

    def health(self) -> str:
        """``"starting"``, ``"ready"``, ``"restarting"`` (its worker died and is being replaced) or
        ``"dead"`` (the vocabulary of ``vllm_omni.engine.workers.supervisor.HEALTH_STATES``)."""
        ...

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the stage (idempotent); queued requests fail with ``StageEngineError``.

        ``timeout``: seconds the whole shutdown may take (requests still running are then
        abandoned and the stage's processes killed); ``None``: the runtime's own bound.
        """
        ...
