"""Qwen2.5-Omni's talker stage: thinker reply -> codec tokens, on vLLM engines.

Hand-off. The thinker stage's output reaches this stage as a
:class:`~vllm_omni.engine.connectors.StagePayload` with ``"prompt_token_ids"`` and
``"output_token_ids"`` (int64 ``[T]`` / ``[n]``) and, in ``meta``, the thinker's adapter of the
request. vLLM 0.32 returns no per-token hidden states from generation, so this stage runs a
**pooling pass** of the thinker's text decoder (``runner="pooling"``, ``token_embed`` / ``ALL``,
no activation: the final, normed hidden states, as transformers' ``hidden_states[-1]``) over
``prompt + output[:-1]`` with the same adapter; the payload gains ``"hidden_states"``
(float32 ``[T + n - 1, E]``). Its cost per request is one prefill of that many tokens
(docs/benchmarks.md).

Inputs, as ``Qwen2_5OmniForConditionalGeneration.generate`` builds them (text prompts):
``x_i = hidden_i + embed(token_i)`` (placeholders of audio/image/video: embedding 0);
prefix = ``[x_0 .. x_{T-1}, embed(speaker bos), x_T]``; the reply stream ``[x_{T+1} .. x_{T+n-2}, embed(text eos),
embed(text pad)]``, whose row ``k`` (the last one once exhausted) is added to the codec
embedding of the token fed at decode step ``k + 1``. Every row goes through
``thinker_to_talker_proj`` before the decoder. (The talker's ``forward`` would add the codec
pad / bos embeddings to the prefix's last two rows when called with an attention mask and no
position ids; transformers 5.19's ``generate`` never calls it so, and this stage computes what
that ``generate`` computes.)

Decoding. The decoder runs on vLLM as a derived ``Qwen2ForCausalLM``
(:func:`~.checkpoint.derive_talker_checkpoint`) fed ``prompt_embeds``. Since each decode
step's input depends on the step (the reply stream), every step is one vLLM request of one
token over the embeddings so far; prefix caching (keyed by the embeddings) recomputes only the
last partial block per step. Greedy or seeded sampling (seed ``s`` -> step ``k`` uses ``s + k``);
``codec bos`` is never sampled (transformers' ``suppress_tokens``); decoding stops at the
talker's ``stop_token_ids`` (default: codec pad and codec end, transformers' default
``talker_eos_token_id``), at ``max_tokens``, or when the sequence fills the stage's
``max_model_len``. Penalties that look at earlier tokens are refused.

The request's ``SamplingParams`` describe the whole codec sequence, never one step: each step's
params are built anew (:meth:`_TalkerRun.step_params`) from the per-token fields of
:data:`STEP_FIELDS`; ``max_tokens`` / ``min_tokens`` / ``stop_token_ids`` / ``allowed_token_ids``
are applied by this stage over the sequence (``min_tokens``: no stop token is sampled before that
many codes, transformers' ``min_new_tokens``), and fields that need text or the whole sequence
(:data:`REFUSED_FIELDS`) are refused.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from vllm import PoolingParams, SamplingParams
from vllm.config import PoolerConfig
from vllm.outputs import PoolingRequestOutput
from vllm.sampling_params import RequestOutputKind

from vllm_omni.engine.connectors import StagePayload
from vllm_omni.engine.llm_stage import LLMStageEngine
from vllm_omni.engine.protocols import StageDescription
from vllm_omni.errors import InvalidRequestError, StageEngineError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest, RequestAdapters
from vllm_omni.stages.qwen2_5_omni.checkpoint import (
    TalkerTables,
    derive_adapter,
    derive_talker_checkpoint,
    derive_thinker_text_checkpoint,
)

logger = logging.getLogger(__name__)

_MM_PLACEHOLDERS = ("audio_token_index", "image_token_index", "video_token_index")
#: ``SamplingParams`` fields that act per sampled token, carried into every one-token step.
STEP_FIELDS = ("temperature", "top_p", "top_k", "min_p", "logit_bias")
#: fields that need text, a whole sequence in one vLLM request or log-probabilities this stage does
#: not return: refused (``InvalidRequestError``) rather than silently dropped.
REFUSED_FIELDS = ("stop", "bad_words", "structured_outputs", "logprobs", "prompt_logprobs")


@dataclass(frozen=True)
class TalkerOutput:
    """The talker's result for one request.

    Attributes:
        codes: codec tokens before the stop token, int64 ``[N]`` (Qwen3-Omni's talker, which shares
            this type: ``[num_code_groups, N]``).
        finish_reason: ``"stop"`` (a stop token) or ``"length"`` (``max_tokens``).
        payload: what code2wav receives: ``{"codes": codes}`` and the request's ``voice`` in ``meta``.
    """

    codes: torch.Tensor
    finish_reason: str
    payload: StagePayload


def build_talker_inputs(
    tables: TalkerTables,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    hidden: torch.Tensor,
    speaker_bos: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The talker's projected prefix and its (unprojected) reply stream (module docstring).

    Args:
        prompt_ids / output_ids: the thinker's prompt and generated ids, int64 ``[T]`` / ``[n]``, n >= 1.
        hidden: the thinker's final hidden states of ``prompt + output[:-1]``, float32 ``[T + n - 1, E]``.
        speaker_bos: the voice's ``bos_token`` (``spk_dict.pt``).

    Returns:
        ``(prefix [T + 2, H] (T + 1 when n == 1), reply [R, E])``, float32.
    """
    ids = torch.cat([prompt_ids, output_ids[:-1]]).long()
    embeds = tables.thinker_embed[ids]
    mm = torch.tensor([tables.ids[k] for k in _MM_PLACEHOLDERS if k in tables.ids], dtype=torch.long)
    embeds[torch.isin(ids, mm)] = 0.0
    x = hidden.float() + embeds
    t = prompt_ids.numel()
    text = tables.thinker_embed
    bos = text[speaker_bos].unsqueeze(0)
    prefix = torch.cat([x[:t], bos, x[t : t + 1]]).clone()
    end = text[tables.ids["tts_text_end_token_id"]].unsqueeze(0)
    pad = text[tables.ids["tts_text_pad_token_id"]].unsqueeze(0)
    reply = torch.cat([x[t + 1 :], end, pad])
    if output_ids.numel() == 1:  # transformers' rewrite: the reply is padding from its start
        reply = pad.expand(2, -1).clone()
    return tables.project(prefix), reply


def derived_adapter(lora_request: LoRARequest | None, sub_model: str) -> LoRARequest | None:
    """``lora_request`` pointing at its copy keyed for the derived ``sub_model`` directory
    (:func:`~.checkpoint.derive_adapter`); same name and id."""
    if lora_request is None:
        return None

    return msgspec.structs.replace(lora_request, lora_path=derive_adapter(lora_request.lora_path, sub_model))


class ThinkerStatesEngine(LLMStageEngine):
    """A pooling vLLM engine over the thinker's text decoder; ``submit(ids, PoolingParams)``
    resolves to a ``PoolingRequestOutput`` whose ``outputs.data`` is float32 ``[len(ids), E]``."""

    _params_type = PoolingParams
    _output_types = (PoolingRequestOutput,)


class TalkerStageEngine(LLMStageEngine):
    """Runs the talker stage (module docstring): ``submit(payload, SamplingParams, lora_request)``
    -> future of :class:`TalkerOutput`.

    Args:
        stage: the talker stage (its ``model`` is the Omni checkpoint; LoRA options are stage-scoped).
        thinker_stage: the thinker's stage; its options (and LoRA options) configure the pooling pass.
        speakers: ``{voice: {"bos_token": int, ...}}`` (``spk_dict.pt``).

    Raises:
        StageEngineError: a checkpoint this stage cannot derive, or an engine that fails to start.
    """

    def __init__(self, stage: Any, thinker_stage: Any, speakers: dict[str, dict[str, Any]]):
        try:
            talker_dir = derive_talker_checkpoint(stage.model)
            thinker_dir = derive_thinker_text_checkpoint(stage.model)
            self.tables = TalkerTables.load(stage.model)
        except Exception as exc:
            raise StageEngineError(
                f"{stage.label}: cannot prepare the talker from {stage.model}: {exc}"
            ) from exc
        self.speakers = speakers
        self.default_voice = next(iter(speakers))
        options = dict(stage.options) | {"enable_prompt_embeds": True, "skip_tokenizer_init": True}
        super().__init__(
            dataclasses.replace(stage, model=talker_dir, model_arch="Qwen2ForCausalLM", options=options)
        )
        #: the longest sequence (prefix + codes) the talker's engine holds
        self.max_len = int(self._engine.vllm_config.model_config.max_model_len)

        pool = PoolerConfig(task="token_embed", tok_pooling_type="ALL", use_activation=False)
        keep = {k: v for k, v in thinker_stage.options.items() if k not in ("enable_prompt_embeds", "runner")}
        pooling_stage = dataclasses.replace(
            thinker_stage,
            stage_id=stage.stage_id,
            model=thinker_dir,
            model_arch="Qwen2ForCausalLM",
            options=keep | {"runner": "pooling", "pooler_config": pool},
        )
        try:
            self.states = ThinkerStatesEngine(pooling_stage)
        except BaseException:
            super().shutdown()
            raise

    def describe(self) -> StageDescription:
        """The LLM stage's description, with codec tokens out (:class:`TalkerOutput`), the
        thinker's payload in, and the voices a request may choose."""
        return dataclasses.replace(
            super().describe(),
            output_kind="codec",
            inputs=frozenset({"stage_payload"}),
            voices=tuple(self.speakers),
        )

    def validate_request(self, request: StageRequest) -> None:
        """The LLM stage's checks plus: a thinker payload, one completion, no history penalties."""
        prompt, params = request.prompt, request.params
        if prompt is not None and not isinstance(prompt, StagePayload):  # None: check params/adapter only
            raise InvalidRequestError(
                f"{self.stage.label} takes the thinker's StagePayload, got {type(prompt).__name__}"
            )
        talker_lora = derived_adapter(request.adapters.lora_request, "talker")
        super().validate_request(StageRequest(None, params, RequestAdapters.of(talker_lora)))
        if (
            params.n != 1
            or params.repetition_penalty != 1.0
            or params.presence_penalty
            or params.frequency_penalty
        ):
            raise InvalidRequestError(
                f"{self.stage.label}: the talker samples one completion without repetition, presence or "
                "frequency penalties (n=1, repetition_penalty=1.0)"
            )
        refused = [name for name in REFUSED_FIELDS if getattr(params, name, None)]
        if refused:
            raise InvalidRequestError(
                f"{self.stage.label}: the talker samples codec tokens one vLLM step at a time and cannot apply "
                f"{refused} (it applies {list(STEP_FIELDS)}, seed, max_tokens, min_tokens, stop_token_ids and "
                "allowed_token_ids); leave them unset in the talker's SamplingParams"
            )
        voice = None if prompt is None else prompt.meta.get("voice")
        if voice is not None and voice not in self.speakers:
            raise InvalidRequestError(
                f"{self.stage.label}: unknown voice {voice!r}; voices: {list(self.speakers)}"
            )

    def submit(self, request: StageRequest) -> Future:
        """Queue one talker request (class docstring); errors as :meth:`validate_request`."""
        self.validate_request(request)
        prompt, params, lora_request = request.prompt, request.params, request.adapters.lora_request
        done: Future = Future()
        ids = [
            prompt.tensor(k, consumer=self.stage.label).long()
            for k in ("prompt_token_ids", "output_token_ids")
        ]
        if ids[1].numel() == 0:
            raise InvalidRequestError(f"{self.stage.label}: the thinker generated no token")
        thinker_lora = derived_adapter(prompt.meta.get("thinker_lora_request"), "thinker")
        if thinker_lora is not None:
            self._refresh_pooling_adapter(thinker_lora)
        seq = torch.cat([ids[0], ids[1][:-1]]).tolist()
        run = _TalkerRun(self, prompt, ids, params, lora_request, done)
        pooled = self.states.submit(
            StageRequest(
                {"prompt_token_ids": seq}, PoolingParams(task="token_embed"), RequestAdapters.of(thinker_lora)
            )
        )
        run.current = pooled
        pooled.add_done_callback(run.on_hidden)
        return done

    def _refresh_pooling_adapter(self, lora: LoRARequest) -> None:
        """Drop the pooling engine's copy of ``lora.lora_int_id`` when it was loaded from another
        path: the thinker stage's ``remove_lora`` does not reach this engine, and an id reused for
        other weights must not be served the old ones."""
        known = self.states._valid_adapters.get(lora.lora_int_id)
        if known is not None and known != lora.lora_path:
            self.states.remove_lora(lora.lora_int_id)

    def step(self, embeds: torch.Tensor, params: SamplingParams, lora_request: LoRARequest | None) -> Future:
        """One decode step: the vLLM request of one token over ``embeds`` (float32 ``[L, H]``)."""
        return self._enqueue({"prompt_embeds": embeds}, params, lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return super().add_lora(derived_adapter(lora_request, "talker"))

    def shutdown(self, timeout: float | None = None) -> None:
        self.states.shutdown(timeout)
        super().shutdown(timeout)


class _TalkerRun:
    """The state of one talker request between its vLLM steps (callbacks on the driver threads)."""

    def __init__(
        self, engine: TalkerStageEngine, payload: StagePayload, ids, params, lora_request, done: Future
    ):
        self.engine, self.payload, self.ids, self.done = engine, payload, ids, done
        self.lora = derived_adapter(lora_request, "talker")
        tid = engine.tables.ids
        self.stops = set(
            params.stop_token_ids or [tid["tts_codec_pad_token_id"], tid["tts_codec_end_token_id"]]
        )
        self.max_tokens = params.max_tokens or 4096
        self.min_tokens = int(params.min_tokens or 0)
        self.seed = params.seed
        self.step_fields = {name: getattr(params, name) for name in STEP_FIELDS}
        bos = tid["tts_codec_start_token_id"]
        wanted = None if params.allowed_token_ids is None else set(params.allowed_token_ids)
        self.allowed = [
            i
            for i in range(engine.tables.codec_embed.shape[0])
            if i != bos and (wanted is None or i in wanted)
        ]
        if not self.allowed:
            raise InvalidRequestError(
                f"{engine.stage.label}: allowed_token_ids leaves no codec token to sample "
                f"(codec ids 0..{engine.tables.codec_embed.shape[0] - 1}, the codec start token excluded)"
            )
        self.allowed_before_min = [i for i in self.allowed if i not in self.stops] or self.allowed
        self.codes: list[int] = []
        self.current: Future | None = None
        done.add_done_callback(self._on_done)

    def _on_done(self, done: Future) -> None:
        current = self.current
        if done.cancelled() and current is not None:
            current.cancel()

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc if isinstance(exc, Exception) else StageEngineError(str(exc)))

    def on_hidden(self, fut: Future) -> None:
        if fut.cancelled() or self.done.done():
            return
        try:
            hidden = fut.result().outputs.data.float().cpu()
            voice = self.payload.meta.get("voice") or self.engine.default_voice
            bos = int(self.engine.speakers[voice]["bos_token"])
            self.payload.tensors["hidden_states"] = hidden
            self.embeds, self.reply = build_talker_inputs(self.engine.tables, *self.ids, hidden, bos)
            if self.embeds.shape[0] >= self.engine.max_len:
                raise InvalidRequestError(
                    f"{self.engine.stage.label}: the talker's prefix ({self.embeds.shape[0]} positions) "
                    f"leaves no room in its max_model_len {self.engine.max_len}"
                )
            self._next()
        except BaseException as exc:
            self._fail(exc)

    def step_params(self) -> SamplingParams:
        """The params of the next one-token step, built from the request's per-token fields only (the
        request's ``max_tokens`` / ``min_tokens`` / stops describe the sequence, which this run tracks)."""
        n = len(self.codes)
        return SamplingParams(
            **self.step_fields,
            seed=None if self.seed is None else self.seed + n,
            max_tokens=1,
            ignore_eos=True,
            detokenize=False,
            allowed_token_ids=self.allowed if n >= self.min_tokens else self.allowed_before_min,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _next(self) -> None:
        self.current = fut = self.engine.step(self.embeds, self.step_params(), self.lora)
        if self.done.cancelled():
            fut.cancel()
        fut.add_done_callback(self.on_token)

    def on_token(self, fut: Future) -> None:
        if fut.cancelled() or self.done.done():
            return
        try:
            token = int(fut.result().outputs[0].token_ids[0])
            if token in self.stops or len(self.codes) >= self.max_tokens:
                self._finish("stop" if token in self.stops else "length")
                return
            self.codes.append(token)
            if len(self.codes) >= self.max_tokens or self.embeds.shape[0] >= self.engine.max_len:
                self._finish("length")
                return
            tables = self.engine.tables
            row = self.reply[min(len(self.codes) - 1, self.reply.shape[0] - 1)]
            x = tables.project((tables.codec_embed[token] + row).unsqueeze(0))
            self.embeds = torch.cat([self.embeds, x])
            self._next()
        except BaseException as exc:
            self._fail(exc)

    def _finish(self, reason: str) -> None:
        codes = torch.tensor(self.codes, dtype=torch.long)
        meta = {"voice": self.payload.meta.get("voice")}
        out = TalkerOutput(codes, reason, StagePayload({"codes": codes}, meta))
        if not self.done.done():
            self.done.set_result(out)
