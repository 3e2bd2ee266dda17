"""Qwen2.5-Omni's talker stage: thinker reply -> codec tokens, one vLLM request per reply.

Hand-off. The thinker stage's output reaches this stage as a
:class:`~vllm_omni.engine.connectors.StagePayload` with ``"prompt_token_ids"`` / ``"output_token_ids"``
(int64 ``[T]`` / ``[n]``) and ``"hidden_states"`` (float32 ``[T + n - 1, E]``): the thinker's final,
normed hidden states of ``prompt + output[:-1]`` from its own generation pass, as transformers'
``hidden_states[-1]`` (:mod:`vllm_omni.engine.hidden_states_stage`). The thinker's weights are held
once, by the thinker stage; audio / image / video positions of the prompt carry what the thinker
computed there, so a prompt with media can be spoken (the stage describes ``"media_payload"``).

Inputs, as ``Qwen2_5OmniForConditionalGeneration.generate`` builds them:
``x_i = hidden_i + embed(token_i)`` (placeholders of audio/image/video: embedding 0, as transformers
zeroes them); prefix = ``[x_0 .. x_{T-1}, embed(speaker bos), x_T]``; the reply stream
``[x_{T+1} .. x_{T+n-2}, embed(text eos), embed(text pad)]``, whose row ``k`` (the last one once
exhausted) is added to the codec embedding of the token fed at decode step ``k + 1``. Every row goes
through ``thinker_to_talker_proj`` before the decoder. (The talker's ``forward`` would add the codec
pad / bos embeddings to the prefix's last two rows when called with an attention mask and no
position ids; transformers 5.19's ``generate`` never calls it so, and this stage computes what
that ``generate`` computes.)

Decoding. The decoder runs on vLLM as a derived ``Qwen2ForCausalLM``
(:func:`~.checkpoint.derive_talker_checkpoint`, whose ``embed_tokens`` is the projected codec
table) fed the prefix as ``prompt_embeds``; the whole reply is one vLLM request. The engine runs
the stepping worker (:mod:`vllm_omni.engine.step_io`), which adds the projected stream row
``W_proj @ row_k`` to the embedding of the token at position ``T + 2 + k`` (``prefix length + k``):
``embed(c) + W row = W (codec(c) + row) + b``, the projected sum transformers feeds. The request reads
nothing from the prefix cache: past the prefix its KV depends on the stream, which vLLM's block hashes
(token ids, prompt embeddings) do not see. Greedy or seeded
sampling (vLLM's per-request generator); ``codec bos`` is never sampled (transformers'
``suppress_tokens``); decoding stops at the talker's ``stop_token_ids`` (default: codec pad and codec
end, transformers' default ``talker_eos_token_id``; the stop token is not returned), at
``max_tokens``, or when the sequence fills the stage's ``max_model_len``; ``min_tokens`` holds the
stop tokens back (transformers' ``min_new_tokens``). Penalties that look at earlier tokens are
refused (the prompt is embeddings, whose ids vLLM would count as token 0).

The request's ``SamplingParams`` describe the whole codec sequence: the per-token fields of
:data:`STEP_FIELDS`, ``seed``, ``max_tokens`` / ``min_tokens`` / ``stop_token_ids`` /
``allowed_token_ids`` are applied (:meth:`TalkerStageEngine.reply_params`); fields that need
text (:data:`REFUSED_FIELDS`) are refused.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from vllm_omni.engine import step_io
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
)

logger = logging.getLogger(__name__)

_MM_PLACEHOLDERS = ("audio_token_index", "image_token_index", "video_token_index")
#: ``SamplingParams`` fields that act per sampled token, carried into the reply's request.
STEP_FIELDS = ("temperature", "top_p", "top_k", "min_p", "logit_bias")
#: fields that need text, log-probabilities this stage does not return, or plugin arguments (the reply's
#: vLLM params are built by the stage): refused (``InvalidRequestError``) rather than silently dropped.
REFUSED_FIELDS = ("stop", "bad_words", "structured_outputs", "logprobs", "prompt_logprobs", "extra_args")


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


def check_one_completion(payload: StagePayload | None, label: str) -> None:
    """The talkers speak one completion: refuse a thinker payload made from several (``n > 1``).

    Raises:
        InvalidRequestError: naming ``label`` (the talker stage), ``n`` and the way to get text.
    """
    n = 1 if payload is None else int(payload.meta.get("completions", 1))
    if n != 1:
        raise InvalidRequestError(
            f"{label}: the talker speaks one completion, and the thinker's request asked for {n} "
            "(SamplingParams n); ask for n=1, or for text only (last_stage=0)"
        )


def derived_adapter(lora_request: LoRARequest | None, sub_model: str) -> LoRARequest | None:
    """``lora_request`` pointing at its copy keyed for the derived ``sub_model`` directory
    (:func:`~.checkpoint.derive_adapter`); same name and id."""
    if lora_request is None:
        return None

    return msgspec.structs.replace(lora_request, lora_path=derive_adapter(lora_request.lora_path, sub_model))


class TalkerStageEngine(LLMStageEngine):
    """Runs the talker stage (module docstring): ``submit(payload, SamplingParams, lora_request)``
    -> future of :class:`TalkerOutput`.

    Args:
        stage: the talker stage (its ``model`` is the Omni checkpoint; LoRA options are stage-scoped).
        speakers: ``{voice: {"bos_token": int, ...}}`` (``spk_dict.pt``).

    Raises:
        StageEngineError: a checkpoint this stage cannot derive, or an engine that fails to start.
        ConfigError: the stage cannot run the stepping worker (:func:`~vllm_omni.engine.step_io.check_in_process`).
    """

    def __init__(self, stage: Any, speakers: dict[str, dict[str, Any]]):
        try:
            talker_dir = derive_talker_checkpoint(stage.model)
            self.tables = TalkerTables.load(stage.model)
        except Exception as exc:
            raise StageEngineError(
                f"{stage.label}: cannot prepare the talker from {stage.model}: {exc}"
            ) from exc
        self.speakers = speakers
        self.default_voice = next(iter(speakers))
        options = step_io.check_in_process(stage, "the talker's reply stream")
        options |= {"enable_prompt_embeds": True, "skip_tokenizer_init": True}
        super().__init__(
            dataclasses.replace(stage, model=talker_dir, model_arch="Qwen2ForCausalLM", options=options)
        )
        #: the longest sequence (prefix + codes) the talker's engine holds
        self.max_len = int(self._engine.vllm_config.model_config.max_model_len)

    def describe(self) -> StageDescription:
        """The LLM stage's description, with codec tokens out (:class:`TalkerOutput`), the
        thinker's payload in, and the voices a request may choose."""
        return dataclasses.replace(
            super().describe(),
            output_kind="codec",
            inputs=frozenset({"stage_payload", "media_payload"}),
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
                f"{self.stage.label}: the talker samples codec tokens, not text, and cannot apply "
                f"{refused} (it applies {list(STEP_FIELDS)}, seed, max_tokens, min_tokens, stop_token_ids and "
                "allowed_token_ids); leave them unset in the talker's SamplingParams"
            )
        check_one_completion(prompt, self.stage.label)
        voice = None if prompt is None else prompt.meta.get("voice")
        if voice is not None and voice not in self.speakers:
            raise InvalidRequestError(
                f"{self.stage.label}: unknown voice {voice!r}; voices: {list(self.speakers)}"
            )

    def submit(self, request: StageRequest) -> Future:
        """Queue one talker request, one vLLM request for the whole reply (class docstring);
        errors as :meth:`validate_request`, plus ``StageEngineError`` when the payload has no
        ``hidden_states`` and ``InvalidRequestError`` when the prefix fills ``max_model_len``."""
        self.validate_request(request)
        prompt, params = request.prompt, request.params
        label = self.stage.label
        ids = [prompt.tensor(k, consumer=label).long() for k in ("prompt_token_ids", "output_token_ids")]
        if ids[1].numel() == 0:
            raise InvalidRequestError(f"{label}: the thinker generated no token")
        if "hidden_states" not in prompt.tensors:
            raise StageEngineError(
                f"{label}: the thinker's payload has no hidden_states (the thinker stage returns them when "
                "a thinker2talker stage consumes it: run the qwen2_5_omni pipeline)"
            )
        hidden = prompt.tensor("hidden_states", consumer=label).float()
        voice = prompt.meta.get("voice") or self.default_voice
        bos = int(self.speakers[voice]["bos_token"])
        prefix, reply = build_talker_inputs(self.tables, *ids, hidden, bos)
        if prefix.shape[0] >= self.max_len:
            raise InvalidRequestError(
                f"{label}: the talker's prefix ({prefix.shape[0]} positions) leaves no room in its "
                f"max_model_len {self.max_len}"
            )
        # embed_tokens holds project(codec) = W codec + b, so project(codec + row) adds W row
        stream = torch.nn.functional.linear(reply, self.tables.proj_weight)
        reply_params = self.reply_params(params, prefix.shape[0])
        return step_io.submit_keyed(
            step_io.StepIOEntry(stream=stream, stream_start=prefix.shape[0]),
            lambda key: self._enqueue(
                {"prompt_embeds": prefix},
                # its KV past the prefix depends on the stream, which vLLM's block hashes do not see
                step_io.with_entry(reply_params, key, label=label, skip_prefix_cache=True),
                derived_adapter(request.adapters.lora_request, "talker"),
            ),
            lambda out, _: self._codes(out, prompt, reply_params.stop_token_ids),
        )

    def reply_params(self, params: SamplingParams, prefix_len: int) -> SamplingParams:
        """The vLLM params of the reply's one request: the request's per-token fields
        (:data:`STEP_FIELDS`) and seed; ``max_tokens`` (default 4096) capped by the room left after
        the prefix; stops (default codec pad and codec end) that ``min_tokens`` holds back; the
        codec start token never sampled.

        Raises:
            InvalidRequestError: ``allowed_token_ids`` leaves no codec token; ``stop_token_ids`` or
                ``logit_bias`` name ids outside the codec vocabulary; ``min_tokens`` exceeds the room left.
        """
        tid = self.tables.ids
        stops = list(params.stop_token_ids or self._default_stops())
        bos = tid["tts_codec_start_token_id"]
        wanted = None if params.allowed_token_ids is None else set(params.allowed_token_ids)
        allowed = [
            i for i in range(self.tables.codec_embed.shape[0]) if i != bos and (wanted is None or i in wanted)
        ]
        if not allowed:
            raise InvalidRequestError(
                f"{self.stage.label}: allowed_token_ids leaves no codec token to sample "
                f"(codec ids 0..{self.tables.codec_embed.shape[0] - 1}, the codec start token excluded)"
            )
        vocab = self.tables.codec_embed.shape[0]
        named = {"stop_token_ids": stops, "logit_bias": list(params.logit_bias or ())}
        for field, token_ids in named.items():
            bad = [t for t in token_ids if not 0 <= int(t) < vocab]
            if bad:
                raise InvalidRequestError(
                    f"{self.stage.label}: {field} {bad} are not codec ids (0..{vocab - 1})"
                )
        room = self.max_len - prefix_len
        min_tokens = int(params.min_tokens or 0)
        if min_tokens > room:
            raise InvalidRequestError(
                f"{self.stage.label}: min_tokens {min_tokens} exceeds the {room} codes left in the talker's "
                f"max_model_len {self.max_len} after its prefix ({prefix_len} positions)"
            )
        return SamplingParams(
            **{name: getattr(params, name) for name in STEP_FIELDS},
            seed=params.seed,
            max_tokens=max(1, min(params.max_tokens or 4096, room)),
            min_tokens=min_tokens,
            stop_token_ids=stops,
            ignore_eos=True,
            detokenize=False,
            allowed_token_ids=allowed,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    @staticmethod
    def _codes(out: Any, payload: StagePayload, stops: list[int]) -> TalkerOutput:
        """The reply's codes from the engine's output (a final stop token dropped)."""
        completion = out.outputs[0]
        codes = list(completion.token_ids)
        stopped = completion.finish_reason == "stop"
        if stopped and codes and codes[-1] in stops:
            codes = codes[:-1]
        tensor = torch.tensor(codes, dtype=torch.long)
        meta = {"voice": payload.meta.get("voice")}
        return TalkerOutput(tensor, "stop" if stopped else "length", StagePayload({"codes": tensor}, meta))

    def _default_stops(self) -> list[int]:
        tid = self.tables.ids
        return [tid["tts_codec_pad_token_id"], tid["tts_codec_end_token_id"]]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return super().add_lora(derived_adapter(lora_request, "talker"))
