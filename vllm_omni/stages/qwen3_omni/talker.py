"""Qwen3-Omni's talker stage: the thinker's reply -> multi-codebook codec codes, with transformers.

The stage runs transformers' own ``Qwen3OmniMoeTalkerForConditionalGeneration`` (an MoE decoder
whose every step also runs the code predictor for the ``num_code_groups - 1`` residual codebooks)
in float32 on one driver thread, one request at a time. Its weights are the ``talker.*`` tensors
of the Omni checkpoint, plus the thinker's token embedding table (``thinker.model.embed_tokens``).

LoRA (``enable_lora`` on this stage; ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``,
``lora_target_modules``): the project's LoRA layers on the talker's ``nn.Linear`` layers
(:mod:`vllm_omni.stages.module_lora`: decoder attention, the shared expert's MLP and its gate, the
text/hidden projections, ``codec_head``, and the code predictor's layers and heads). A request's
adapter for this stage applies to its whole decode (every talker and code-predictor step) at scale
1.0. Keys as peft saves an adapter trained on ``Qwen3OmniMoeTalkerForConditionalGeneration``
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), or on the whole Omni model
(``base_model.model.talker.model...``). Refused, naming the adapter and key, before a request starts:
targets of the MoE experts (``mlp.experts``: fused parameters, not linear layers) and keys that bind
no talker layer (an adapter for the thinker or another model).

Hand-off: the thinker's :class:`~vllm_omni.engine.connectors.StagePayload` (``thinker2talker``:
``prompt_token_ids`` / ``output_token_ids`` int64 ``[T]`` / ``[n]``, the request's ``voice`` in
``meta``). Inputs are built as ``Qwen3OmniMoeForConditionalGeneration.generate`` (transformers
5.19) builds them for one text prompt (:func:`build_talker_inputs`). For text, that ``generate``
reads only the thinker's *input embeddings* (its hidden states at layer 0) of the prompt and the
reply, never a deeper layer (those feed the talker at audio/image/video placeholders only), so
the embedding table suffices and the thinker's decoder runs once, in the thinker stage. A prompt
with audio: the thinker stage returns its hidden states after the talker's ``accept_hidden_layer``
layers (``layer_hidden_states``, from its own pass: :mod:`vllm_omni.engine.hidden_states_stage`),
and the audio positions' rows are their ``hidden_projection``, as transformers builds them.
Image/video prompts are refused (not checked against transformers here).

Decoding is transformers' ``generate`` of the talker, with the sampling it is given
(:func:`generate_kwargs`); the codes are ``[num_code_groups, N]`` (the codec-eos step excluded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerForConditionalGeneration,
)
from vllm import SamplingParams

from vllm_omni.engine.connectors import StagePayload
from vllm_omni.engine.protocols import StageDescription
from vllm_omni.errors import InvalidRequestError, StageEngineError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest
from vllm_omni.stages.model_driver import ModelStageDriver, load_submodule
from vllm_omni.stages.module_lora import ModuleLoRASpec
from vllm_omni.stages.qwen2_5_omni.checkpoint import load_prefixed
from vllm_omni.stages.qwen2_5_omni.talker import TalkerOutput, check_one_completion

#: transformers' talker defaults (``generate``'s ``talker_*`` arguments).
TALKER_DEFAULTS = {
    "temperature": 0.9,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.05,
    "max_tokens": 4096,
}
#: ``SamplingParams`` fields this stage does not apply: refused when set.
REFUSED_FIELDS = (
    "stop",
    "stop_token_ids",
    "bad_words",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "allowed_token_ids",
    "min_p",
    "structured_outputs",
)


#: Why the talker refuses adapters on its MoE experts (``ModuleLoRASpec.refused``).
EXPERTS_REFUSAL = (
    "the talker's MoE experts (mlp.experts): they are fused parameters (mlp.experts.gate_up_proj "
    "[E, 2I, H], mlp.experts.down_proj [E, H, I]), not linear layers, and this stage applies LoRA to "
    "linear layers only (attention, mlp.shared_expert, the code predictor); train the adapter without "
    "expert targets (peft: no target_parameters on mlp.experts)"
)
#: How the talker's layers are named, for adapters whose keys bind none.
KEYS_HINT = (
    "talker adapters name its layers as peft does on Qwen3OmniMoeTalkerForConditionalGeneration "
    "('base_model.model.model.layers.0.self_attn.q_proj', 'base_model.model.code_predictor.model.layers.0"
    ".mlp.up_proj') or on the whole Omni model ('base_model.model.talker.model.layers...'); an adapter "
    "for the thinker (keys 'thinker.') goes to the thinker stage"
)


_EXPERT_KEY = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with per-expert MoE weights (``...mlp.experts.{e}.{gate,up,down}_proj.weight``, the
    layout transformers 5 saves) stacked into the fused parameters its modules hold:
    ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and ``experts.down_proj``
    ``[E, H, I]`` (what ``from_pretrained`` does with the ``qwen2_moe`` conversion mapping)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for key, value in state.items():
        m = _EXPERT_KEY.match(key)
        if m is None:
            out[key] = value
        else:
            groups.setdefault(m["experts"], {})[(int(m["e"]), m["proj"])] = value
    for prefix, weights in groups.items():
        n = 1 + max(e for e, _ in weights)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([weights[(e, "gate_proj")], weights[(e, "up_proj")]]) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([weights[(e, "down_proj")] for e in range(n)])
    return out


def default_talker_params() -> SamplingParams:
    """``SamplingParams`` of the talker when a request gives none (:data:`TALKER_DEFAULTS`)."""
    return SamplingParams(**TALKER_DEFAULTS)


@dataclass(frozen=True)
class TalkerIds:
    """Token ids the talker's input layout uses (``Qwen3OmniMoeConfig`` and its talker config)."""

    im_start: int
    assistant: int
    user: int
    tts_bos: int
    tts_eos: int
    tts_pad: int
    codec_head: tuple[int, ...]  # nothink, think_bos, think_eos, (speaker), pad, bos
    codec_eos: int
    speakers: dict[str, int]
    placeholders: tuple[int, ...]  # the thinker's audio / image / video tokens

    @classmethod
    def from_config(cls, config: Any) -> TalkerIds:
        t = config.talker_config
        return cls(
            config.im_start_token_id,
            config.assistant_token_id,
            config.user_token_id,
            config.tts_bos_token_id,
            config.tts_eos_token_id,
            config.tts_pad_token_id,
            (t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id, t.codec_pad_id, t.codec_bos_id),
            t.codec_eos_token_id,
            {str(k).lower(): int(v) for k, v in (t.speaker_id or {}).items()},
            tuple(getattr(config.thinker_config, f"{m}_token_id") for m in ("audio", "image", "video")),
        )


def build_talker_inputs(
    talker: Any,
    embed: torch.Tensor,
    ids: TalkerIds,
    prompt: torch.Tensor,
    reply: torch.Tensor,
    speaker: int,
    layer_hidden: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The talker's ``generate`` inputs for one prompt, as transformers' Omni ``generate`` builds them.

    Args:
        talker: the talker module (``text_projection``, ``hidden_projection``, codec embeddings).
        embed: the thinker's token embedding table, float32 ``[V, E]``.
        prompt / reply: the thinker's prompt and generated ids, int64 ``[T]`` / ``[n]``, n >= 2; the
            prompt holds an ``<|im_start|>assistant`` turn.
        speaker: the codec id of the voice.
        layer_hidden: the thinker's hidden states after ``accept_hidden_layer`` layers, float32
            ``[T + n - 1, E]``; needed when the prompt holds audio/image/video placeholders, whose user
            rows are ``hidden_projection`` of them (the others: ``text_projection`` of the embeddings).

    Returns:
        ``inputs_embeds`` ``[1, L, H]``, ``talker_input_ids`` ``[1, L]``, ``trailing_text_hidden``
        ``[1, n - 1, H]`` (the reply from its second token, then tts-eos), ``tts_pad_embed`` ``[1, 1, H]``.
        Rows: every prompt token of a user turn (a turn is the tokens from one ``<|im_start|>`` to the
        next; its role is the token after it), projected; then the assistant head: its first 3 rows
        (``<|im_start|>``, role, newline), 4 tts-pad, tts-bos, the reply's first token, each row plus
        the codec embedding of (0, 0, 0, nothink, think-bos, think-eos, speaker, codec-pad, codec-bos).
    """
    project = talker.text_projection
    fed = torch.cat([prompt, reply[:-1]])  # the tokens the thinker was fed: hidden_states[0] rows
    x = embed[fed]
    t = prompt.numel()
    pos = torch.arange(t)
    turn = torch.cummax(torch.where(prompt == ids.im_start, pos, -1), 0).values.clamp(min=0)
    user = prompt[(turn + 1).clamp(max=t - 1)] == ids.user
    starts = ((prompt[:-1] == ids.im_start) & (prompt[1:] == ids.assistant)).nonzero().flatten()
    a = int(starts[-1])
    head_text = project(x[a:])
    bos, eos, pad = project(embed[[ids.tts_bos, ids.tts_eos, ids.tts_pad]]).unbind(0)
    codec_ids = torch.tensor([*ids.codec_head[:3], speaker, *ids.codec_head[3:]])
    codec = torch.cat([torch.zeros(3, head_text.shape[-1]), talker.get_input_embeddings()(codec_ids)])
    head = torch.cat([head_text[:3], pad.expand(4, -1), bos[None], head_text[3:4]]) + codec
    user_rows = project(x[:t])
    media = torch.isin(prompt, torch.tensor(ids.placeholders))
    if bool(media.any()):
        user_rows[media] = talker.hidden_projection(layer_hidden[:t][media].float())
    rows = torch.cat([user_rows[user], head])
    input_ids = torch.cat([prompt[user], torch.full((head.shape[0],), ids.tts_pad)])
    return {
        "inputs_embeds": rows[None],
        "talker_input_ids": input_ids[None],
        "trailing_text_hidden": torch.cat([head_text[4:], eos[None]])[None],
        "tts_pad_embed": pad[None, None],
    }


def generate_kwargs(params: SamplingParams, talker_vocab: int, codec_eos: int) -> dict[str, Any]:
    """transformers ``generate`` options of the talker from ``params``: ``temperature == 0`` is
    greedy (and so is the code predictor, as transformers mirrors the talker's ``do_sample``);
    the top 1024 ids but codec-eos are never sampled (transformers' ``suppress_tokens``)."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": params.max_tokens or TALKER_DEFAULTS["max_tokens"],
        "min_new_tokens": params.min_tokens or 0,
        "eos_token_id": codec_eos,
        "suppress_tokens": [i for i in range(talker_vocab - 1024, talker_vocab) if i != codec_eos],
        "repetition_penalty": params.repetition_penalty,
        "do_sample": params.temperature > 0,
        "output_hidden_states": True,
        "return_dict_in_generate": True,
    }
    if kwargs["do_sample"]:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
    return kwargs


class TalkerStageEngine(ModelStageDriver):
    """Runs Qwen3-Omni's talker: ``submit`` -> future of a
    :class:`~vllm_omni.stages.qwen2_5_omni.talker.TalkerOutput` whose ``codes`` are int64
    ``[num_code_groups, N]``; its payload (``{"codes": ...}``, ``voice`` in ``meta``) is code2wav's input.

    Raises:
        StageEngineError: no model directory, or the checkpoint cannot be loaded.
    """

    kind = "talker"
    output_kind = "codec"
    params_type = SamplingParams

    def __init__(self, stage: Any, takes_media: bool = False):
        #: the thinker stage returns its capture layer's hidden states for prompts with audio
        self.takes_media = takes_media
        super().__init__(stage)

    def describe(self) -> StageDescription:
        """The driver's description; ``"media_payload"`` in when the thinker hands over what prompts
        with audio need (:attr:`takes_media`)."""
        described = super().describe()
        if not self.takes_media:
            return described
        return dataclasses.replace(described, inputs=described.inputs | {"media_payload"})

    def load(self, model_dir: str) -> None:
        """The talker (experts fused), the thinker's embedding table and the token ids."""
        config = AutoConfig.from_pretrained(model_dir)
        self.ids = TalkerIds.from_config(config)
        self.model = load_submodule(
            Qwen3OmniMoeTalkerForConditionalGeneration,
            config.talker_config,
            model_dir,
            "talker.",
            fuse_experts,
        )
        self.embed = load_prefixed(model_dir, "thinker.model.embed_tokens.")["weight"].float()
        if not self.ids.speakers:
            raise StageEngineError(f"the talker config of {model_dir} names no speaker")
        self.vocab = config.talker_config.text_config.vocab_size

    @property
    def voices(self) -> list[str]:
        return list(self.ids.speakers)

    def lora_spec(self) -> ModuleLoRASpec:
        """LoRA on the talker module (its MoE experts refused: :data:`EXPERTS_REFUSAL`)."""
        return ModuleLoRASpec(
            self.model,
            "the Qwen3-Omni talker (Qwen3OmniMoeTalkerForConditionalGeneration)",
            prefixes=("talker.",),
            refused=((".mlp.experts.", EXPERTS_REFUSAL),),
            hint=KEYS_HINT,
        )

    def validate_request(self, request: StageRequest) -> None:
        """A thinker payload with a reply of at least 2 tokens, a known voice, ``SamplingParams``
        without the :data:`REFUSED_FIELDS`, ``n == 1``; an adapter only with LoRA on, through the
        adapter gate (``InvalidAdapterError`` naming the adapter and the key)."""
        prompt, params = request.prompt, request.params
        voice = None if prompt is None or prompt.meta.get("voice") is None else prompt.meta["voice"].lower()
        self.check_request(request, SamplingParams, "thinker", voice, self.voices)
        refused = [name for name in REFUSED_FIELDS if params is not None and getattr(params, name, None)]
        if refused or (params is not None and params.n != 1):
            raise InvalidRequestError(
                f"{self.stage.label}: the talker applies temperature, top_k, top_p, repetition_penalty, seed, "
                f"max_tokens and min_tokens to one completion (n=1); leave {refused or ['n']} unset"
            )
        if prompt is None:
            return
        check_one_completion(prompt, self.stage.label)
        reply = prompt.tensor("output_token_ids", consumer=self.stage.label)
        if reply.numel() < 2:
            raise InvalidRequestError(
                f"{self.stage.label}: the thinker's reply has {reply.numel()} token(s); the talker needs at least 2"
            )
        ids = prompt.tensor("prompt_token_ids", consumer=self.stage.label)
        self._check_media(ids, prompt)
        if not bool(((ids[:-1] == self.ids.im_start) & (ids[1:] == self.ids.assistant)).any()):
            raise InvalidRequestError(
                f"{self.stage.label}: the prompt has no '<|im_start|>assistant' turn (use the chat template)"
            )

    def _check_media(self, ids: torch.Tensor, payload: StagePayload) -> None:
        """A prompt with placeholders needs the thinker's capture-layer hidden states; audio only.

        Raises:
            InvalidRequestError: image/video placeholders, or audio ones without those hidden states
                (the thinker stage cannot return them: ``tensor_parallel_size`` > 1 or its engine core
                in another process), naming the stage.
        """
        audio, *visual = self.ids.placeholders
        if bool(torch.isin(ids, torch.tensor(visual)).any()):
            raise InvalidRequestError(
                f"{self.stage.label}: the prompt holds image/video placeholders; the talker speaks replies to "
                "text and audio prompts (image/video are not checked against transformers): ask for text only "
                "(last_stage=0)"
            )
        if bool((ids == audio).any()) and "layer_hidden_states" not in payload.tensors:
            raise InvalidRequestError(
                f"{self.stage.label}: the prompt holds audio placeholders and the thinker stage returned no "
                "hidden states of the talker's accept_hidden_layer (it returns them with tensor_parallel_size 1 "
                "and its engine core in the stage's process); ask for text only (last_stage=0)"
            )

    def prepare(
        self, request: StageRequest
    ) -> tuple[torch.Tensor, torch.Tensor, str, SamplingParams, LoRARequest | None, torch.Tensor | None]:
        prompt = request.prompt
        ids = [
            prompt.tensor(k, consumer=self.stage.label).long()
            for k in ("prompt_token_ids", "output_token_ids")
        ]
        voice = (
            prompt.meta.get("voice") or ("ethan" if "ethan" in self.ids.speakers else self.voices[0])
        ).lower()
        lora = request.adapters.lora_request if request.adapters else None
        layer = prompt.tensors.get("layer_hidden_states")
        return ids[0], ids[1], voice, request.params or default_talker_params(), lora, layer

    @torch.inference_mode()
    def run(
        self,
        work: tuple[torch.Tensor, torch.Tensor, str, SamplingParams, LoRARequest | None, torch.Tensor | None],
    ) -> TalkerOutput:
        """The codes of one request; its adapter (if any) acts on every step, projections included."""
        prompt, reply, voice, params, lora, layer = work
        with self.lora.applied(lora) if self.lora is not None else contextlib.nullcontext():
            inputs = build_talker_inputs(
                self.model, self.embed, self.ids, prompt, reply, self.ids.speakers[voice], layer
            )
            kwargs = generate_kwargs(params, self.vocab, self.ids.codec_eos)
            with torch.random.fork_rng(devices=[]):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                out = self.model.generate(
                    **inputs, attention_mask=torch.ones_like(inputs["talker_input_ids"]), **kwargs
                )
        steps = [h[-1] for h in out.hidden_states if h[-1] is not None]
        groups = self.model.config.num_code_groups
        codes = torch.stack(steps, 1)[0].T.contiguous() if steps else torch.zeros(groups, 0, dtype=torch.long)
        stopped = int(out.sequences[0, -1]) == self.ids.codec_eos
        payload = StagePayload({"codes": codes}, {"voice": voice})
        return TalkerOutput(codes, "stop" if stopped else "length", payload)


__all__ = ["TalkerStageEngine", "build_talker_inputs", "default_talker_params", "generate_kwargs"]
