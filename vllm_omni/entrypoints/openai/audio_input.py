"""Audio input of ``/v1/chat/completions`` (OpenAI's ``input_audio`` content parts).

A user message may carry ``{"type": "input_audio", "input_audio": {"data": <base64>, "format":
"wav"}}`` parts beside its text when the entry stage takes audio (an Omni thinker: its description's
``media_limits``). Each part is decoded here (WAV with the stdlib ``wave`` module: 8/16/24/32-bit
PCM, channels averaged to mono) and placed in the conversation the way vLLM's own OpenAI server
renders it: a chat template that walks a message's content parts gets ``{"type": "audio"}`` parts
(the template writes the placeholder, e.g. Qwen2.5-Omni's ``<|audio_bos|><|AUDIO|><|audio_eos|>``);
a template that takes string content gets the placeholder (the tokenizer's audio tokens) before the
message's text. The clips go to ``AsyncOmni`` as the prompt's ``multi_modal_data``; vLLM's processor
expands the placeholders.

Refused with a 400 naming the part (``messages[i].content[j]``): audio to a model that takes none,
more parts than the stage's ``limit_mm_per_prompt``, data that is not base64, a format this server
cannot decode (WAV only: no MP3 decoder is installed), a file ``wave`` cannot read, no samples, and
a sample rate other than the feature extractor's when vLLM cannot resample (torchaudio missing).
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import io
import wave
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_omni.entrypoints.openai.errors import bad_request
from vllm_omni.entrypoints.openai.protocol import ChatCompletionRequest, InputAudio, InputAudioPart

#: The formats this server decodes.
INPUT_AUDIO_FORMATS = ("wav",)

#: PCM sample width (bytes) -> (numpy dtype, offset, scale) to floats in [-1, 1].
_PCM = {1: ("u1", 128.0, 128.0), 2: ("<i2", 0.0, 32768.0), 4: ("<i4", 0.0, 2.0**31)}


@dataclass
class ChatAudio:
    """A conversation ready for the chat template, and its audio clips in placeholder order."""

    messages: list[dict[str, Any]]
    clips: list[tuple[np.ndarray, int]] = field(default_factory=list)
    placeholder: str | None = None  # the token vLLM's processor expands, one per clip


def audio_parts(req: ChatCompletionRequest) -> list[tuple[str, InputAudioPart]]:
    """Every ``input_audio`` part of the request with its place (``messages[i].content[j]``)."""
    return [
        (f"messages[{i}].content[{j}]", part)
        for i, m in enumerate(req.messages)
        if isinstance(m.content, list)
        for j, part in enumerate(m.content)
        if isinstance(part, InputAudioPart)
    ]


def refuse_audio(req: ChatCompletionRequest, why: str) -> None:
    """Refuse the first audio part of ``req`` (the server's model takes none): ``why`` says so."""
    parts = audio_parts(req)
    if parts:
        at = parts[0][0]
        raise bad_request(f"{at}: {why}", at)


def _pcm_samples(raw: bytes, width: int, channels: int) -> np.ndarray:
    if width == 3:  # 24-bit little-endian: widen to 32 bits
        b = np.frombuffer(raw[: len(raw) // 3 * 3], dtype=np.uint8).reshape(-1, 3)
        wide: np.ndarray = np.zeros((len(b), 4), dtype=np.uint8)
        wide[:, 1:] = b
        samples = wide.view("<i4").reshape(-1).astype(np.float32) / 2.0**31
    else:
        dtype, offset, scale = _PCM[width]
        samples = (np.frombuffer(raw, dtype=dtype).astype(np.float32) - offset) / scale
    usable = len(samples) // channels * channels
    return samples[:usable].reshape(-1, channels).mean(axis=1, dtype=np.float32)


def decode_input_audio(audio: InputAudio, at: str, rate: int | None) -> tuple[np.ndarray, int]:
    """``(mono float32 samples, sample rate)`` of one ``input_audio``; ``rate``: the rate the stage
    takes (another one is refused when vLLM's resampler, torchaudio, is not installed).

    Raises:
        OpenAIError: (400, ``param`` ``at``) see the module docstring.
    """
    fmt = audio.format.lower()
    if fmt not in INPUT_AUDIO_FORMATS:
        raise bad_request(
            f"{at}: audio format {audio.format!r} cannot be decoded by this server (no decoder for it is "
            f"installed); send {', '.join(INPUT_AUDIO_FORMATS)} (16-bit PCM)",
            at,
        )
    try:
        raw = base64.b64decode("".join(audio.data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{at}: input_audio.data is not valid base64 ({exc})", at) from exc
    try:
        with wave.open(io.BytesIO(raw)) as w:
            channels, width, sr = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError, ValueError) as exc:
        detail = str(exc) or "the data ends before its WAV header does"
        raise bad_request(
            f"{at}: not a WAV file this server reads (PCM, 8 to 32 bits): {detail}", at
        ) from exc
    if width not in (1, 2, 3, 4) or channels < 1 or sr <= 0:
        raise bad_request(f"{at}: unsupported WAV ({channels} channels, {8 * width}-bit, {sr} Hz)", at)
    samples = _pcm_samples(frames, width, channels)
    if samples.size == 0:
        raise bad_request(f"{at}: the WAV file holds no samples", at)
    if rate is not None and sr != rate and importlib.util.find_spec("torchaudio") is None:
        raise bad_request(
            f"{at}: sample rate {sr} Hz: this model takes {rate} Hz and the server cannot resample "
            f"(torchaudio is not installed); resample the audio to {rate} Hz before sending it",
            at,
        )
    return samples, sr


def _audio_placeholder(tokenizer: Any) -> str | None:
    """The placeholder of one clip in a string-content prompt (``<|audio_bos|><|AUDIO|><|audio_eos|>``)
    and the token vLLM expands; ``None`` when the tokenizer has no audio token."""
    token = getattr(tokenizer, "audio_token", None)
    if not token:
        return None
    bos, eos = (
        getattr(tokenizer, "audio_bos_token", None) or "",
        getattr(tokenizer, "audio_eos_token", None) or "",
    )
    return f"{bos}{token}{eos}"


def _content(message: Any, where: str, openai_format: bool, placeholder: str) -> Any:
    """One message's content for the template: its parts (``{"type": "audio"}`` for a clip) when the
    template walks them, else its placeholders then its texts, joined by newlines (as vLLM does)."""
    if not isinstance(message.content, list) or not any(
        isinstance(p, InputAudioPart) for p in message.content
    ):
        return message.text(where)
    if openai_format:
        return [
            {"type": "audio"} if isinstance(p, InputAudioPart) else {"type": "text", "text": p.text}
            for p in message.content
        ]
    clips = [placeholder for p in message.content if isinstance(p, InputAudioPart)]
    texts = [p.text for p in message.content if not isinstance(p, InputAudioPart)]
    return "\n".join(clips + (["\n".join(texts)] if texts else []))


def chat_audio(info: Any, tokenizer: Any, template: str | None, req: ChatCompletionRequest) -> ChatAudio:
    """The conversation of ``req`` for the chat template ``template`` and its decoded clips.

    Raises:
        OpenAIError: (400) an image part, or an audio part this server cannot take (module docstring).
    """
    parts = audio_parts(req)
    if not parts:
        return ChatAudio(
            [{"role": m.role, "content": m.text(f"messages[{i}]")} for i, m in enumerate(req.messages)]
        )
    limit = info.media_limits.get("audio", 0)
    placeholder = _audio_placeholder(tokenizer)
    if placeholder is None or limit == 0:
        started = " (it was started with limit_mm_per_prompt audio 0)" if placeholder else ""
        refuse_audio(req, f"this model takes no audio input{started}")
    if len(parts) > limit:
        at = parts[limit][0]
        raise bad_request(
            f"{at}: {len(parts)} audio parts; this server takes at most {limit} per request", at
        )
    clips = [decode_input_audio(part.input_audio, at, info.audio_sample_rate) for at, part in parts]
    from vllm.renderers.hf import _detect_content_format  # how vLLM's server tells the two apart

    openai_format = bool(template) and _detect_content_format(template, default="string") == "openai"
    messages = [
        {"role": m.role, "content": _content(m, f"messages[{i}]", openai_format, placeholder)}
        for i, m in enumerate(req.messages)
    ]
    return ChatAudio(messages, clips, tokenizer.audio_token)


def check_placeholders(audio: ChatAudio, text: str) -> None:
    """Refuse a templated prompt whose audio placeholders are not one per clip (a template that drops
    them, or a text that spells one itself).

    Raises:
        OpenAIError: (400, ``messages``).
    """
    found = text.count(audio.placeholder or "")
    if found != len(audio.clips):
        raise bad_request(
            f"the templated conversation holds {found} {audio.placeholder} audio placeholders for "
            f"{len(audio.clips)} input_audio parts (one per part; the text must not spell them)",
            "messages",
        )
