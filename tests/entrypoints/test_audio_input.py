"""``input_audio`` chat parts without a server (:mod:`vllm_omni.entrypoints.openai.audio_input`): WAV
decoding of every PCM width and of stereo, and the prompt text on the tiny Qwen3-Omni checkpoint (the
Qwen2.5-Omni one is checked end to end in ``test_audio_server.py``) and on a template that walks content
parts, as vLLM's server renders them."""

from __future__ import annotations

import base64
import io
import wave
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import test_assets_root
from vllm_omni.entrypoints.openai.audio_input import chat_audio, check_placeholders, decode_input_audio
from vllm_omni.entrypoints.openai.protocol import ChatCompletionRequest, InputAudio
from vllm_omni.errors import OpenAIError


def _wav(ints: np.ndarray, width: int, channels: int = 1, rate: int = 16000) -> str:
    """``ints`` (frames x channels, signed, or unsigned for 8 bits) as WAV bytes, little-endian, base64."""
    data = np.asarray(ints, dtype=np.int64).reshape(-1)
    raw = b"".join(int(v).to_bytes(width, "little", signed=width > 1) for v in data)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_pcm_widths_and_stereo_decode_to_mono_floats(width):
    bits = 8 * width
    rng = np.random.default_rng(width)
    if width == 1:  # unsigned, 128 is silence
        ints = rng.integers(0, 256, size=(50, 2))
        expected = (ints - 128) / 128.0
    else:
        ints = rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), size=(50, 2))
        expected = ints / 2.0 ** (bits - 1)
    samples, rate = decode_input_audio(InputAudio(data=_wav(ints, width, 2), format="wav"), "at", 16000)
    assert rate == 16000 and samples.dtype == np.float32
    np.testing.assert_allclose(samples, expected.mean(axis=1), atol=1e-6)


def test_refusals_name_the_part():
    cases = [
        (InputAudio(data=_wav(np.zeros(10), 2, rate=22050), format="wav"), "sample rate 22050 Hz: .*16000"),
        (InputAudio(data=_wav(np.zeros(0), 2), format="wav"), "the WAV file holds no samples"),
        (InputAudio(data="UklGRg==", format="wav"), "not a WAV file"),
        (InputAudio(data="abc", format="wav"), "input_audio.data is not valid base64"),
        (InputAudio(data=_wav(np.zeros(10), 2), format="flac"), "audio format 'flac' cannot be decoded"),
    ]
    for audio, message in cases:
        with pytest.raises(OpenAIError, match="^messages\\[2\\].content\\[1\\]: " + message) as err:
            decode_input_audio(audio, "messages[2].content[1]", 16000)
        assert err.value.status == 400 and err.value.param == "messages[2].content[1]"


def _request(*parts):
    content = [{"type": "text", "text": "Listen."}, *parts, {"type": "text", "text": "What is it?"}]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": content}]})


def _part():
    return {"type": "input_audio", "input_audio": {"data": _wav(np.zeros(1600), 2), "format": "wav"}}


@pytest.fixture(scope="module")
def tiny_qwen3_omni_assets():
    from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets

    return ensure_tiny_qwen3_omni_assets(test_assets_root())


def test_qwen3_omni_string_template_gets_vllms_placeholder(tiny_qwen3_omni_assets):
    """The tiny Qwen3-Omni template takes string content: the placeholder (vLLM's
    ``get_placeholder_str`` for Qwen3-Omni audio) then the texts, joined by newlines, as vLLM's server."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_omni_assets.model_dir)
    info = SimpleNamespace(media_limits={"audio": 1}, audio_sample_rate=16000)
    audio = chat_audio(info, tok, tok.chat_template, _request(_part()))
    text = tok.apply_chat_template(audio.messages, tokenize=False, add_generation_prompt=True)
    content = "<|audio_start|><|audio_pad|><|audio_end|>\nListen.\nWhat is it?"
    assert text == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    check_placeholders(audio, text)
    with pytest.raises(
        OpenAIError, match=r"holds 2 <\|audio_pad\|> audio placeholders for 1 input_audio parts"
    ):
        check_placeholders(audio, text + "<|audio_pad|>")
    with pytest.raises(OpenAIError, match=r"^messages\[0\].content\[2\]: 2 audio parts; .* at most 1") as err:
        chat_audio(info, tok, tok.chat_template, _request(_part(), _part()))
    assert err.value.param == "messages[0].content[2]"


#: A template that walks content parts, as the real Qwen2.5-Omni checkpoint's does.
WALKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for c in m.content %}{% if c.type == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
)


def test_a_template_walking_content_parts_places_the_audio_in_order(tiny_omni_assets):
    from transformers import AutoTokenizer
    from vllm.renderers.hf import _detect_content_format

    assert _detect_content_format(WALKING, default="string") == "openai"
    tok = AutoTokenizer.from_pretrained(tiny_omni_assets.model_dir)
    info = SimpleNamespace(media_limits={"audio": 1}, audio_sample_rate=16000)
    audio = chat_audio(info, tok, WALKING, _request(_part()))
    text = tok.apply_chat_template(audio.messages, chat_template=WALKING, tokenize=False)
    assert text == "<|im_start|>user\nListen.<|audio_bos|><|AUDIO|><|audio_eos|>What is it?<|im_end|>\n"
    assert [len(c) for c, _ in audio.clips] == [1600]
    # no audio limit (a text-only model, or a thinker started with audio 0): the part is named
    with pytest.raises(OpenAIError, match=r"^messages\[0\].content\[1\]: this model takes no audio input"):
        chat_audio(SimpleNamespace(media_limits={}, audio_sample_rate=None), tok, WALKING, _request(_part()))
