"""Request bodies of the OpenAI-compatible routes (pydantic), and their conversion to params.

Unknown top-level fields are ignored, as OpenAI-compatible servers do (clients send
fields a server may not use); fields that are present are type-checked. The ``lora``
field is kept raw here and parsed by :mod:`vllm_omni.entrypoints.openai.lora`, which
gives precise messages.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from vllm_omni.entrypoints.openai.errors import bad_request, validation_message
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

MAX_N = 16
MAX_PIXELS_SIDE = 4096
MAX_STEPS = 1000
MAX_PROMPTS = 32
MAX_LOGPROBS = 20  # vLLM's default ``max_logprobs``; OpenAI's ``top_logprobs`` bound
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(BaseModel):
    """OpenAI's ``input_audio``: base64 audio (no ``data:`` prefix) and its format."""

    model_config = ConfigDict(extra="ignore")
    data: str
    format: str = Field(max_length=32)


class InputAudioPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_audio"]
    input_audio: InputAudio


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart | InputAudioPart] | None = None
    name: str | None = None

    def text(self, where: str = "messages") -> str:
        """The message's text; ``where``: its place in the request (``messages[i]``), named when an
        audio part is refused (callers that take audio read it first, :mod:`..audio_input`)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if any(isinstance(p, ImagePart) for p in self.content):
            raise bad_request("image inputs in chat messages are not supported by this server", "messages")
        for j, part in enumerate(self.content):
            if isinstance(part, InputAudioPart):
                at = f"{where}.content[{j}]"
                raise bad_request(f"{at}: this model takes no audio input", at)
        return "".join(p.text for p in self.content if isinstance(p, TextPart))  # the others were refused


class StreamOptions(_Body):
    """OpenAI ``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``: ``name``, ``schema`` (a JSON Schema), ``strict``."""

    name: str = Field(default="response", min_length=1, max_length=64)
    description: str | None = Field(default=None, max_length=4096)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON valid for ``json_schema.schema``), enforced by vLLM's structured outputs."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """vLLM's constraint for this format (``None`` for ``text``).

        Raises:
            OpenAIError: (400, ``response_format``) ``json_schema`` without a valid schema.
        """
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        if schema is None:
            raise bad_request("response_format: type json_schema needs json_schema.schema", "response_format")
        import jsonschema

        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise bad_request(
                f"response_format.json_schema.schema is not a valid JSON Schema: {exc.message}",
                "response_format",
            ) from exc
        return StructuredOutputsParams(json=schema)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token id strings -> -100..100) as vLLM takes it (int keys).

    Raises:
        OpenAIError: (400, ``logit_bias``) a key that is not a token id, a value out of range.
    """
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.strip().isdecimal():
            raise bad_request(f"logit_bias: key {key!r} is not a token id", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias[{key}]: {value} is outside -100..100", "logit_bias")
        out[int(key)] = float(value)
    return out


#: OpenAI tool-calling fields: refused (400 naming the field) while no tool parser is served
_TOOL_FIELDS = ("tools", "functions", "function_call")


class SamplingFields(_Body):
    """OpenAI/vLLM text sampling fields shared by chat and completions."""

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # the engine's generator is int64
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    lora: Any = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    #: OpenAI's token bias: token id (as a string) -> -100..100, added to the logits (vLLM's ``logit_bias``)
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields (its OpenAI server takes them too): passed to ``SamplingParams``
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = Field(default=None, max_length=1024)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = Field(default=None, max_length=1024)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=1 << 20)
    # OpenAI fields that change the answer and are not served: a 400 naming them (never ignored)
    suffix: Any = None
    best_of: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def logprob_count(self) -> int | None:
        """``SamplingParams.logprobs``: alternatives per generated token (``None``: no log-probabilities)."""
        return None

    def refuse_tools(self) -> None:
        """Fields that would change the answer in a way this server does not serve: a 400 naming the
        field. Tool calling (no tool-call parser runs on the output: ``tools``, ``functions``,
        ``function_call``, a ``tool_choice`` other than ``none`` / ``auto``), ``suffix`` (insertion),
        ``best_of`` above 1, ``prediction``, ``reasoning_effort``, ``web_search_options``. Empty lists
        and ``null`` ask for nothing and pass; OpenAI's bookkeeping fields (``user``, ``store``,
        ``metadata``, ``service_tier``, ``parallel_tool_calls``) are ignored, as they change no answer.

        Raises:
            OpenAIError: (400) one of those fields set.
        """
        for name in ("suffix", "prediction", "reasoning_effort", "web_search_options"):
            if getattr(self, name) not in (None, ""):
                raise bad_request(f"{name}: not supported by this server; send the request without it", name)
        if self.best_of not in (None, 1):
            raise bad_request("best_of: only 1 is supported (use n for several completions)", "best_of")
        for name in _TOOL_FIELDS:
            if getattr(self, name):
                raise bad_request(
                    f"{name}: this server does not parse tool calls (no tool-call parser runs on the "
                    f"output); send the request without {name}",
                    name,
                )
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: no tools are served", "tool_choice")

    def sampling_params(self, default_max_tokens: int = 16, stream: bool = False):
        """vLLM ``SamplingParams`` of these fields; ``stream``: ask the LLM stage for DELTA outputs.

        Raises:
            OpenAIError: (400) a combination vLLM refuses.
        """
        kwargs: dict[str, Any] = {"n": self.n, "max_tokens": self.max_tokens or default_max_tokens}
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_tokens",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        for name in (
            "min_p",
            "stop_token_ids",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "bad_words",
            "allowed_token_ids",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.logit_bias:
            kwargs["logit_bias"] = _logit_bias(self.logit_bias)
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        kwargs["ignore_eos"] = self.ignore_eos
        if stream:
            kwargs["output_kind"] = RequestOutputKind.DELTA
        logprobs = self.logprob_count()
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        if self.response_format is not None:
            kwargs["structured_outputs"] = self.response_format.structured_outputs()

        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError, VLLMClientError) as exc:  # e.g. n > 1 with greedy sampling
            raise bad_request(f"invalid sampling parameters: {exc}") from exc


class DiffusionFields(_Body):
    """Image/video generation fields (also accepted by chat completions on image pipelines)."""

    size: str | None = None
    height: int | None = Field(default=None, ge=1, le=MAX_PIXELS_SIDE)
    width: int | None = Field(default=None, ge=1, le=MAX_PIXELS_SIDE)
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    negative_prompt: str | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    num_frames: int | None = Field(default=None, ge=1, le=1024)
    lora: Any = None

    def hw(self) -> tuple[int | None, int | None]:
        """``(height, width)`` from ``height``/``width`` or ``size="WxH"``."""
        height, width = self.height, self.width
        if self.size is not None and self.size != "auto":
            match = _SIZE.match(self.size)
            if not match:
                raise bad_request(f"size must look like '512x512' (WIDTHxHEIGHT), got {self.size!r}", "size")
            width, height = int(match[1]), int(match[2])
        for name, value in (("height", height), ("width", width)):
            if value is not None and (not 16 <= value <= MAX_PIXELS_SIDE or value % 16):
                raise bad_request(
                    f"{name} must be a multiple of 16 in [16, {MAX_PIXELS_SIDE}], got {value}",
                    "size" if self.size else name,
                )
        return height, width

    def diffusion_params(self, n: int = 1, defaults: Any = None):
        """The request's diffusion settings (its adapters travel separately, as ``RequestAdapter`` s);
        ``defaults`` (the stage's :class:`~vllm_omni.config.call_defaults.CallDefaults`, what ``/ui/info``
        shows) gives the steps and guidance the request leaves unset."""
        height, width = self.hw()
        kwargs: dict[str, Any] = {"num_images_per_prompt": n, "height": height, "width": width}
        for name in ("num_inference_steps", "guidance_scale", "negative_prompt", "seed"):
            value = getattr(self, name)
            if value is None and name in ("num_inference_steps", "guidance_scale"):
                value = getattr(defaults, name, None)
            if value is not None:
                kwargs[name] = value
        if self.num_frames is not None:
            kwargs["extra_args"] = {"num_frames": self.num_frames}
        try:
            return OmniDiffusionSamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise bad_request(f"invalid generation parameters: {exc}") from exc


class AudioOutputFields(_Body):
    """``audio`` of a chat request (OpenAI's audio output parameters); checked by the route,
    which knows the pipeline's voices and formats."""

    voice: str = Field(min_length=1, max_length=256)
    format: str = Field(min_length=1, max_length=32)


class ChatCompletionRequest(SamplingFields, DiffusionFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = Field(default=None, min_length=1)
    audio: AudioOutputFields | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprob_count(self) -> int | None:
        """``top_logprobs`` (0 by default) when ``logprobs`` is true.

        Raises:
            OpenAIError: (400, ``top_logprobs``) given without ``logprobs: true``.
        """
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0

    @property
    def wants_audio(self) -> bool:
        """Whether the reply must carry audio (``"audio"`` among ``modalities``)."""
        return "audio" in (self.modalities or ())


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[Any]:
        p = self.prompt
        if isinstance(p, str):
            out: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [{"prompt_token_ids": list(p)}]
        else:
            out = [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]
        if not out or len(out) > MAX_PROMPTS:
            raise bad_request(f"prompt must hold 1 to {MAX_PROMPTS} prompts", "prompt")
        for x in out:
            if isinstance(x, dict) and not x["prompt_token_ids"]:
                raise bad_request("a token-id prompt must not be empty", "prompt")
        return out


class TokenizeCompletionRequest(_Body):
    """vLLM's ``POST /tokenize`` body for a text prompt."""

    model: str | None = Field(default=None, max_length=4096)
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """vLLM's ``POST /tokenize`` body for a conversation (rendered by the chat template)."""

    model: str | None = Field(default=None, max_length=4096)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    """vLLM's ``POST /detokenize`` body."""

    model: str | None = Field(default=None, max_length=4096)
    tokens: list[int] = Field(max_length=1_000_000)


class ImageGenerationRequest(DiffusionFields):
    model: str | None = None
    prompt: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    response_format: Literal["b64_json"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)


class VideoGenerationRequest(DiffusionFields):
    model: str | None = None
    prompt: str = Field(min_length=1)
    fps: int = Field(default=8, ge=1, le=120)
    # None: MP4 when OpenCV can write it, else GIF; "png": lossless, one PNG per frame in ``frames``
    video_format: Literal["mp4", "gif", "png"] | None = None
    #: the first frame of an image-to-video request (OpenAI's ``POST /v1/videos`` field name): in a JSON
    #: body base64 or a ``data:image/...;base64,`` URI; in a multipart body a file (read by the route)
    input_reference: str | None = Field(default=None, min_length=1)


class LoadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False
    #: vllm-omni: the denoiser of a two-denoiser stage the adapter acts on when a request names none
    #: (``transformer`` / ``high_noise``, ``transformer_2`` / ``low_noise``); ``add_lora(denoiser=...)``.
    denoiser: str | None = Field(default=None, min_length=1, max_length=64)


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


def _unicode_problem(value: Any, where: str) -> str | None:
    """The place of the first string in ``value`` that is not valid Unicode (a lone surrogate
    such as ``"\\ud800"``, which JSON can spell but UTF-8 cannot encode), else ``None``."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return at
        elif isinstance(item, dict):
            stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in item.items())
            stack.extend((k, at or "body") for k in item if isinstance(k, str))
        elif isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
    return None


#: Top-level fields that hold free text (prompts, messages, stop strings, JSON schemas): any character
#: but NUL. Every other string field is a name, path, size or keyword: printable text only.
FREE_TEXT_FIELDS = frozenset(
    {
        "prompt",
        "messages",
        "negative_prompt",
        "stop",
        "bad_words",
        "suffix",
        "prediction",
        "response_format",
        "tools",
        "functions",
        "chat_template_kwargs",
    }
)
#: Characters a name, path or keyword never holds: C0 controls (tab and newlines too) and DEL.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: The longest name, path or keyword (a path's ``PATH_MAX``).
MAX_NAME_CHARS = 4096


def text_problem(value: Any, field: str) -> str | None:
    """Why the strings in the top-level field ``field`` (its value ``value``) are refused, else ``None``:
    a NUL character anywhere; in a field outside :data:`FREE_TEXT_FIELDS` also any other control
    character or more than :data:`MAX_NAME_CHARS` characters. The message names the place
    (``lora[0].path``) and the character."""
    free = field in FREE_TEXT_FIELDS
    stack = [(value, field)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            bad = "\x00" if free and "\x00" in item else None
            if not free:
                match = _CONTROL.search(item)
                bad = match.group() if match else None
            if bad is not None:
                what = "NUL" if bad == "\x00" else f"control character U+{ord(bad):04X}"
                kind = "text" if free else "a name, path or keyword (printable text only)"
                return f"{at}: holds a {what} at position {item.index(bad)}; {at} is {kind}"
            if not free and len(item) > MAX_NAME_CHARS:
                return f"{at}: {len(item)} characters, more than the {MAX_NAME_CHARS} a name, path or keyword may have"
        elif isinstance(item, dict):
            stack.extend((v, f"{at}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
    return None


def parse_body(model: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body; any problem is a 400 with the field names.

    Raises:
        OpenAIError: (400) not an object, text that is not valid Unicode (an unpaired
            surrogate escape), a control character or length :func:`text_problem` refuses,
            or a field pydantic refuses; ``param``: the top-level field.
    """
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}", "body")
    bad_text = _unicode_problem(data, "")
    if bad_text is not None:
        raise bad_request(
            f"{bad_text}: text holds an unpaired surrogate escape (such as \\ud800), which is not "
            f"valid Unicode",
            bad_text.split(".")[0].split("[")[0],
        )
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    for name, value in data.items():
        problem = text_problem(value, name) if name in known else None  # unknown fields are ignored
        if problem is not None:
            raise bad_request(problem, name)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        loc = errors[0].get("loc", ()) if errors else ()
        param = str(loc[0]) if loc and isinstance(loc[0], str) else None  # the top-level field at fault
        raise bad_request(validation_message(exc), param) from exc
