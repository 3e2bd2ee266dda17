"""Audio output of ``/v1/chat/completions`` (OpenAI's ``modalities`` / ``audio`` / ``message.audio``).

A request asks for audio with ``"modalities": ["text", "audio"]`` and
``"audio": {"voice": ..., "format": "wav"}``; the reply's message then carries
``audio = {id, data (base64 WAV), expires_at, transcript}`` and ``content`` is ``null``, as
OpenAI answers. WAV is 16-bit PCM mono at the pipeline's sample rate (stdlib ``wave``).
"""

from __future__ import annotations

import base64
import io
import time
import uuid
import wave
from typing import Any

import numpy as np

from vllm_omni.entrypoints.openai.errors import bad_request
from vllm_omni.errors import OpenAIError
from vllm_omni.inputs.audio import AudioParams

#: Formats the server encodes.
AUDIO_FORMATS = ("wav",)
#: Seconds until ``message.audio.expires_at`` (nothing is stored server-side: a client cannot
#: refer to the audio in a later turn, so the value only fills OpenAI's field).
AUDIO_TTL_S = 3600


def wav_bytes(waveform: np.ndarray, sample_rate: int) -> bytes:
    """A WAV file (16-bit PCM, mono) of ``waveform`` (1-D float samples in [-1, 1]; clipped)."""
    pcm = (np.clip(np.asarray(waveform, dtype=np.float32).reshape(-1), -1.0, 1.0) * 32767.0).round()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


def audio_request_params(info: Any, req: Any) -> Any:
    """The code2wav ``AudioParams`` of a chat request that asks for audio, else ``None``.

    Raises:
        OpenAIError: (400) audio asked of a pipeline without an audio stage (``modalities``), no
            ``audio`` object (``audio``), a format other than WAV (``audio.format``), an unknown
            voice (``audio.voice``), streaming (``stream``) or several choices (``n``).
    """
    if not req.wants_audio:
        return None
    if "audio" not in info.output_kinds:
        raise bad_request(f"pipeline {info.pipeline!r} does not produce audio", "modalities")
    if req.audio is None:
        raise bad_request('audio output needs "audio": {"voice": ..., "format": "wav"}', "audio")
    if req.audio.format not in AUDIO_FORMATS:
        raise bad_request(
            f"audio format {req.audio.format!r} is not supported; formats: {', '.join(AUDIO_FORMATS)}",
            "audio.format",
        )
    if req.audio.voice not in info.voices:
        raise bad_request(
            f"unknown voice {req.audio.voice!r}; voices: {', '.join(info.voices)}", "audio.voice"
        )
    if req.stream:
        raise bad_request("audio output cannot be streamed; send stream=false", "stream")
    if req.n != 1:
        raise bad_request("audio output takes one choice (n=1)", "n")

    return AudioParams(voice=req.audio.voice, seed=req.seed)


def audio_message(outputs: list[Any], transcript: str | None) -> dict[str, Any]:
    """OpenAI's ``message.audio`` for the audio among ``outputs``; 500 when there is none."""
    found = [o for o in outputs if getattr(o, "audio", None) is not None]
    if not found:
        raise OpenAIError("the pipeline returned no audio", 500)
    out = found[-1]
    return {
        "id": f"audio_{uuid.uuid4().hex}",
        "data": base64.b64encode(wav_bytes(out.audio, out.sample_rate)).decode("ascii"),
        "expires_at": int(time.time()) + AUDIO_TTL_S,
        "transcript": transcript or "",
    }
