"""A stage that runs one transformers module, one request at a time, on its own driver thread.

Shared by the Omni families' stages that vLLM does not run (Qwen2.5-Omni's code2wav, Qwen3-Omni's
talker and code2wav). A subclass implements :meth:`~ModelStageDriver.load` (its module, from the
stage's model directory; it sets ``output_kind`` / ``params_type`` / ``voices`` for ``describe``), :meth:`~ModelStageDriver.validate_request` (every check, nothing queued),
:meth:`~ModelStageDriver.prepare` (what the driver thread needs of a request: tensors, params) and
:meth:`~ModelStageDriver.run` (one result from that, on the driver thread).

LoRA: a subclass whose module takes adapters returns a :class:`~vllm_omni.stages.module_lora.ModuleLoRASpec`
from :meth:`~ModelStageDriver.lora_spec`; with ``enable_lora`` on the stage, :attr:`ModelStageDriver.lora`
is then a :class:`~vllm_omni.stages.module_lora.ModuleLoRA` (the adapter gate, the management calls; ``run``
applies a request's adapter with :meth:`~vllm_omni.stages.module_lora.ModuleLoRA.applied`). Without it,
the LoRA management calls raise ``LoRANotEnabledError`` naming the stage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni.engine.connectors import StagePayload
from vllm_omni.engine.protocols import OutputKind, StageDescription
from vllm_omni.engine.stage_driver import StageDriver
from vllm_omni.errors import InvalidRequestError, LoRANotEnabledError, StageEngineError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.stages.module_lora import ModuleLoRA, ModuleLoRASpec

logger = logging.getLogger(__name__)


def load_submodule(
    module_cls: Any,
    sub_config: Any,
    model_dir: str,
    prefix: str,
    convert: Callable[[dict], dict] | None = None,
) -> torch.nn.Module:
    """transformers' ``module_cls`` built from ``sub_config`` with the checkpoint's ``prefix*`` tensors
    (prefix removed; ``convert`` applied), float32, eval.

    Raises:
        RuntimeError: the tensors do not fit the module (``load_state_dict(strict=True)``).
    """
    from vllm_omni.stages.qwen2_5_omni.checkpoint import load_prefixed

    module = module_cls._from_config(sub_config, dtype=torch.float32)
    state = load_prefixed(model_dir, prefix)
    module.load_state_dict({k: v.float() for k, v in (convert or dict)(state).items()})
    return module.float().eval()


@dataclass
class _Pending:
    work: Any
    future: Future
    submitted: float = field(default_factory=time.monotonic)
    adapters: tuple[str, ...] = ()  # the request's adapter names, for the statistics


class ModelStageDriver(StageDriver):
    """``submit(StageRequest)`` -> a future of :meth:`run`'s result, one request at a time.

    Attributes:
        kind: what the stage is, in messages (``"code2wav"``, ``"talker"``).
    """

    kind = "stage"
    #: what :meth:`describe` reports: the output, the per-request params, the voices a request may choose
    output_kind: OutputKind = "audio"
    params_type: type = object
    voices: tuple[str, ...] | list[str] = ()

    def __init__(self, stage: Any):
        """Load the stage's module (:meth:`load`) and start the driver thread.

        Raises:
            StageEngineError: no model directory, a checkpoint that cannot be loaded, or LoRA
                options the stage does not take (all of them when :meth:`lora_spec` is ``None``);
                the message names the stage.
        """
        self.stage = stage
        if not stage.model:
            raise StageEngineError(f"{stage.label}: no model directory given for the {self.kind} stage")
        try:
            self.load(stage.model)
        except StageEngineError as exc:
            raise StageEngineError(f"{stage.label}: {exc}") from exc
        except Exception as exc:  # a checkpoint transformers cannot read, or weights that do not fit
            raise StageEngineError(
                f"{stage.label}: cannot load the {self.kind} from {stage.model}: {exc}"
            ) from exc
        self._start()

    def load(self, model_dir: str) -> None:
        """Load the module and what requests need from ``model_dir`` (on the constructing thread)."""
        raise NotImplementedError

    def lora_spec(self) -> ModuleLoRASpec | None:
        """What LoRA binds to on this stage (after :meth:`load`); ``None``: it runs without LoRA."""
        return None

    def _start(self) -> None:
        """Set up LoRA (``enable_lora``) and start the driver thread (after the module is loaded).

        Raises:
            StageEngineError: the stage's options enable LoRA, which it does not run, or LoRA
                options it does not take.
        """
        config = getattr(self.stage, "lora_config", None)
        spec = None if config is None else self.lora_spec()
        if config is not None and spec is None:
            raise StageEngineError(
                f"{self.stage.label} ({self.kind}) runs without LoRA: remove enable_lora (and the other "
                "LoRA options) from this stage"
            )
        #: the stage's LoRA (``None`` without ``enable_lora``)
        self.lora = None if spec is None else ModuleLoRA(spec, config, self.stage.label, self.stage.options)
        self._init_driver()
        self._thread = threading.Thread(
            target=self._drive, name=f"omni-stage-{self.stage.stage_id}", daemon=True
        )
        self._thread.start()

    def validate_request(self, request: StageRequest) -> None:
        """Every check of :meth:`submit`, queueing nothing (``InvalidRequestError`` ...)."""
        raise NotImplementedError

    def describe(self) -> StageDescription:
        """:attr:`output_kind` out, the previous stage's payload in, :attr:`params_type`, the
        :attr:`voices`; LoRA as an LLM stage's (one adapter per request) when enabled."""
        return StageDescription(
            self.stage.stage_id,
            self.stage.label,
            self.output_kind,
            frozenset({"stage_payload"}),
            self.params_type,
            voices=tuple(self.voices),
            adapters=None if self.lora is None else self.lora.capabilities(),
        )

    def check_request(
        self, request: StageRequest, params_type: type, source: str, voice: str | None = None, voices=()
    ) -> None:
        """The checks every such stage makes: an adapter only with LoRA on (one, passing the
        adapter gate :meth:`~vllm_omni.stages.module_lora.ModuleLoRA.check`), params of
        ``params_type`` (or none), a ``voice`` among ``voices`` (when given), and a prompt that is
        the ``source`` stage's :class:`~vllm_omni.engine.connectors.StagePayload` (when given).

        Raises:
            LoRANotEnabledError / InvalidAdapterError / InvalidRequestError: naming the stage.
        """
        prompt, params = request.prompt, request.params
        if request.adapters:
            self._require_lora().check(request.adapters.lora_request)
        if params is not None and not isinstance(params, params_type):
            raise InvalidRequestError(
                f"{self.stage.label} takes {params_type.__name__}, got {type(params).__name__}"
            )
        if voice is not None and voice not in voices:
            raise InvalidRequestError(f"{self.stage.label}: unknown voice {voice!r}; voices: {list(voices)}")
        if prompt is not None and not isinstance(prompt, StagePayload):
            raise InvalidRequestError(
                f"{self.stage.label} takes the {source}'s StagePayload, got {type(prompt).__name__}"
            )

    def prepare(self, request: StageRequest) -> Any:
        """What :meth:`run` needs of a validated request (on the caller's thread)."""
        raise NotImplementedError

    def run(self, work: Any) -> Any:
        """One result from :meth:`prepare`'s ``work`` (on the driver thread)."""
        raise NotImplementedError

    def submit(self, request: StageRequest) -> Future:
        """Queue one request.

        Raises (synchronously): what :meth:`validate_request` raises, ``StageEngineError`` (shut
        down / dead).
        """
        self.validate_request(request)
        names = tuple(a.lora.lora_name or str(a.lora.lora_int_id) for a in request.adapters or ())
        item = _Pending(self.prepare(request), Future(), adapters=names)
        with self._cv:
            self._raise_if_unusable()
            self._queue.append(item)
            self._cv.notify()
        return item.future

    def _no_lora_message(self) -> str:
        if self.lora_spec() is None:
            return f"{self.stage.label} ({self.kind}) does not support LoRA: it takes no adapter"
        return (
            f"{self.stage.label} ({self.kind}) does not have LoRA enabled; set enable_lora=True on this stage "
            f'(stage_overrides={{"{self.stage.stage_id}": {{"enable_lora": true}}}})'
        )

    def _require_lora(self) -> ModuleLoRA:
        if self.lora is None:
            raise LoRANotEnabledError(self._no_lora_message())
        return self.lora

    def add_lora(self, lora_request: Any) -> bool:
        """Check then load an adapter into the host cache; ``True`` when newly loaded.

        Raises:
            LoRANotEnabledError, InvalidAdapterError (nothing loaded), LoRACacheError.
        """
        start = time.perf_counter()
        added = self._require_lora().add(lora_request)
        name = lora_request.lora_name or str(lora_request.lora_int_id)
        self.recorder.loaded(name, time.perf_counter() - start if added else None, lora_request.lora_int_id)
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter (on the driver thread, between requests); ``False`` when not loaded."""
        lora = self._require_lora()
        entry = lora.manager.cache_entry(lora_int_id)
        removed = self._call(lambda: lora.remove(lora_int_id))
        if removed and entry is not None:
            self.recorder.unloaded(entry.name or str(lora_int_id), version=lora_int_id)
        return removed

    def list_loras(self) -> set[int]:
        return self._require_lora().ids()

    def pin_lora(self, lora_int_id: int) -> bool:
        lora = self._require_lora()
        pinned = lora.pin(lora_int_id)
        entry = lora.manager.cache_entry(lora_int_id)
        self.recorder.pinned((entry.name if entry is not None else None) or str(lora_int_id), lora_int_id)
        return pinned

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the driver (a running request finishes first, up to ``timeout`` s, default 60)."""
        deadline = time.monotonic() + (60.0 if timeout is None else timeout)
        self._stop_driver(self._thread, deadline - time.monotonic())

    def _drive(self) -> None:
        while (work := self._next_work(self._queue.popleft)) is not None:
            commands, item = work
            self._run_commands(commands)
            if item is None or not item.future.set_running_or_notify_cancel():
                continue
            try:
                result = self.run(item.work)
            except Exception as exc:
                logger.warning("%s: %s failed: %s", self.stage.label, self.kind, exc)
                self.recorder.request_done(item.adapters, time.monotonic() - item.submitted, False)
                item.future.set_exception(StageEngineError(f"{self.stage.label}: {self.kind} failed: {exc}"))
                continue
            self.recorder.request_done(item.adapters, time.monotonic() - item.submitted, True)
            item.future.set_result(result)
