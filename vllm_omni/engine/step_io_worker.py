"""vLLM workers whose model runner applies :mod:`vllm_omni.engine.step_io` entries.

Imported by vLLM in the engine (``EngineArgs.worker_cls`` = :data:`~vllm_omni.engine.step_io.CPU_WORKER`
or :data:`~vllm_omni.engine.step_io.GPU_WORKER`), never by the driver. The worker is vLLM's own for
the platform; only its model runner is replaced by a subclass that overrides ``_model_forward``
(vLLM 0.32, ``vllm/v1/worker/gpu_model_runner.py``: "can be overridden by subclasses for model
execution"). Requests without an entry are untouched, so a batch may mix both kinds.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_omni.engine.step_io import AUX_LAYERS_KEY, StepIOEntry, lookup


class StepIORunnerMixin:
    """``_model_forward`` with each keyed request's stream added before and hidden states copied after."""

    #: the engine returns the capture layer's hidden states beside the final ones (set at load)
    _step_io_layers: bool = False

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's ``load_model``, then the capture layers of ``additional_config`` set on the model
        (before anything is compiled: the first forward is after loading)."""
        super().load_model(*args, **kwargs)
        layers = (self.vllm_config.additional_config or {}).get(AUX_LAYERS_KEY)
        if layers and not getattr(self, "use_aux_hidden_state_outputs", False):
            model = self.get_model()
            if not hasattr(model, "set_aux_hidden_state_layers"):
                raise RuntimeError(
                    f"{type(model).__name__} cannot return the hidden states of a decoder layer "
                    "(vLLM's SupportsEagle3.set_aux_hidden_state_layers)"
                )
            model.set_aux_hidden_state_layers(tuple(int(x) for x in layers))
            self._step_io_layers = True

    def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's profiling / warm-up run calls the model directly: with capture layers set it returns
        ``(final, [layer])``, which vLLM unpacks only when it asked for auxiliary states itself."""
        if not self._step_io_layers:
            return super()._dummy_run(*args, **kwargs)
        self.use_aux_hidden_state_outputs = True
        try:
            return super()._dummy_run(*args, **kwargs)
        finally:
            self.use_aux_hidden_state_outputs = False

    def _step_io_spans(self) -> list[tuple[StepIOEntry, int, int, int]]:
        """``(entry, first token, end token, position of the first token)`` of the keyed requests in
        this step's token layout (``query_start_loc``: requests in ``input_batch`` order)."""
        batch = self.input_batch
        starts = self.query_start_loc.np
        spans = []
        for i, req_id in enumerate(batch.req_ids):
            state = self.requests.get(req_id)
            params = None if state is None else state.sampling_params
            entry = None if params is None else lookup(params.extra_args)
            if entry is not None:
                first, end = int(starts[i]), int(starts[i + 1])
                if end > first:
                    spans.append((entry, first, end, int(batch.num_computed_tokens_cpu[i])))
        return spans

    def _model_forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> Any:
        spans = self._step_io_spans()
        for entry, first, end, pos in spans:
            if entry.stream is None:
                continue
            if inputs_embeds is None:
                raise RuntimeError(
                    "a step_io stream needs input embeddings: start the engine with enable_prompt_embeds"
                )
            index = torch.arange(pos, pos + end - first) - entry.stream_start
            keep = index >= 0
            if bool(keep.any()):
                rows = entry.stream[index[keep].clamp(max=entry.stream.shape[0] - 1)]
                at = torch.arange(first, end, device=inputs_embeds.device)[keep.to(inputs_embeds.device)]
                inputs_embeds[at] += rows.to(inputs_embeds.device, inputs_embeds.dtype)
        out = super()._model_forward(
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
            **model_kwargs,
        )
        layer = None
        if self._step_io_layers and isinstance(out, tuple):  # (final, [capture layer]): vLLM expects final
            out, layer = out[0], out[1][0]
        hidden = out[0] if isinstance(out, tuple) else out
        if isinstance(hidden, torch.Tensor):
            for entry, first, end, pos in spans:
                if entry.capture:
                    entry.captured.append((pos, _rows(hidden, first, end)))
                    if layer is not None:
                        entry.captured_layer.append((pos, _rows(layer, first, end)))
        return out


def _rows(states: torch.Tensor, first: int, end: int) -> torch.Tensor:
    return states[first:end].detach().to("cpu", torch.float32).clone()


class StepIOCPUModelRunner(StepIORunnerMixin, CPUModelRunner):
    """vLLM's CPU model runner with :class:`StepIORunnerMixin`."""


class StepIOCPUWorker(CPUWorker):
    """vLLM's CPU worker running :class:`StepIOCPUModelRunner` (the v1 runner only)."""

    def init_device(self) -> None:
        super().init_device()
        if getattr(self, "use_v2_model_runner", False):
            raise RuntimeError("vllm_omni's step_io worker supports vLLM's v1 model runner only")
        self.model_runner = StepIOCPUModelRunner(self.vllm_config, torch.device("cpu"))


def __getattr__(name: str) -> Any:
    """``StepIOGPUWorker`` built on first use (importing the GPU worker on a CPU host is not needed)."""
    if name != "StepIOGPUWorker":
        raise AttributeError(name)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    class StepIOGPUModelRunner(StepIORunnerMixin, GPUModelRunner):
        pass

    class StepIOGPUWorker(Worker):
        def init_device(self) -> None:
            super().init_device()
            if getattr(self, "use_v2_model_runner", False):
                raise RuntimeError("vllm_omni's step_io worker supports vLLM's v1 model runner only")
            self.model_runner = StepIOGPUModelRunner(self.vllm_config, self.device)

    globals()["StepIOGPUWorker"] = StepIOGPUWorker
    return StepIOGPUWorker
