"""An LLM stage whose outputs carry the final hidden states of the engine's own pass.

:class:`HiddenStatesStageEngine` is :class:`~vllm_omni.engine.llm_stage.LLMStageEngine` with every
request captured by the stepping worker (:mod:`vllm_omni.engine.step_io`): when a request
finishes, its ``RequestOutput`` gains ``omni_hidden_states``, float32 ``[T + n - 1, H]``: the
final (normed) hidden state of each prompt position and of each generated token but the last
(the last one is never fed back), what transformers returns as ``hidden_states[-1]`` of a
forward over ``prompt + output[:-1]``. A downstream stage (the Qwen2.5-Omni talker) reads them, so
the model's weights are held once, by this stage.

Cost: the rows are copied out each step (``H`` floats per computed position), and the request
reads nothing from the prefix cache (``skip_reading_prefix_cache``: a cached prefix would not be
computed, hence not captured). A request for several completions (``n > 1``) is not captured:
vLLM runs it as child requests that share its params, and the hidden states would be one
completion's; its outputs carry none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vllm import RequestOutput

from vllm_omni.engine import step_io
from vllm_omni.engine.llm_stage import LLMStageEngine
from vllm_omni.inputs.stage_request import StageRequest

#: the ``RequestOutput`` attribute that holds the captured hidden states
HIDDEN_STATES_ATTR = "omni_hidden_states"
#: ... and the one that holds those of the capture layer (``capture_layer``), same shape
LAYER_HIDDEN_STATES_ATTR = "omni_layer_hidden_states"


class HiddenStatesStageEngine(LLMStageEngine):
    """An LLM stage returning hidden states with each output (module docstring).

    Args:
        stage: the LLM stage.
        capture_layer: also return the residual stream after this many decoder layers
            (:data:`LAYER_HIDDEN_STATES_ATTR`; transformers' ``hidden_states[capture_layer]``), for a
            model with vLLM's ``SupportsEagle3`` (e.g. the Qwen3-Omni thinker).
        wanted: ``prompt -> bool``: capture only the requests it accepts (default: every request);
            the others read the prefix cache and return no hidden states.

    Raises:
        ConfigError: the stage cannot run the stepping worker (:func:`step_io.check_in_process`).
        StageEngineError: as ``LLMStageEngine``.
    """

    def __init__(
        self, stage: Any, capture_layer: int | None = None, wanted: Callable[[Any], bool] | None = None
    ):
        options = step_io.check_in_process(
            stage, "returning the hidden states to the next stage", capture_layer
        )
        self.capture_layer = capture_layer
        self.wanted = wanted
        super().__init__(dataclasses.replace(stage, options=options))

    def validate_request(self, request: StageRequest) -> None:
        """The LLM stage's checks plus ``extra_args`` (:func:`~vllm_omni.engine.step_io.check_extra_args`)."""
        super().validate_request(request)
        step_io.check_extra_args(request.params, self.stage.label)

    def _enqueue(
        self,
        prompt: Any,
        params: Any,
        lora_request: Any,
        on_partial: Callable[[RequestOutput], None] | None = None,
    ) -> Future:
        if self.wanted is not None and not self.wanted(prompt):
            return super()._enqueue(prompt, params, lora_request, on_partial)
        if getattr(params, "n", 1) != 1:  # vLLM runs n > 1 as child requests sharing extra_args
            return super()._enqueue(prompt, params, lora_request, on_partial)
        return step_io.submit_keyed(
            step_io.StepIOEntry(capture=True),
            lambda key: super(HiddenStatesStageEngine, self)._enqueue(
                prompt,
                step_io.with_entry(params, key, label=self.stage.label, skip_prefix_cache=True),
                lora_request,
                on_partial,
            ),
            self._attach,
        )

    def _attach(self, out: RequestOutput, entry: step_io.StepIOEntry) -> RequestOutput:
        """``out`` with its hidden states (:data:`HIDDEN_STATES_ATTR`, and the capture layer's).

        Raises:
            StageEngineError: a fed position was never computed.
        """
        fed = len(out.prompt_token_ids or ()) + max(0, len(out.outputs[0].token_ids) - 1)
        setattr(out, HIDDEN_STATES_ATTR, step_io.hidden_states(entry, fed, self.stage.label))
        if self.capture_layer is not None:
            layer = step_io.hidden_states(entry, fed, self.stage.label, layer=True)
            setattr(out, LAYER_HIDDEN_STATES_ATTR, layer)
        return out
