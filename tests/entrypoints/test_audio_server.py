"""`vllm-omni serve <tiny Qwen2.5-Omni> --pipeline qwen2_5_omni`: chat with audio output over real HTTP.

One server for the module. The openai client reads ``message.audio`` (base64 WAV and its
transcript); a request that does not ask for audio gets text only; bad audio fields are 400s
naming the field. Audio input (``input_audio`` parts, the thinker takes one clip): the prompt ids
and greedy tokens equal transformers' thinker on the same WAV samples; bad parts are 400s naming
``messages[i].content[j]``, and the server keeps serving.
"""

from __future__ import annotations

import base64
import io
import json
import re
import wave

import openai
import pytest

from tests.entrypoints.server_utils import (
    HTTP,
    assert_openai_error,
    free_port,
    input_audio_part,
    serve_command,
    server_env,
    start_server,
)
from tools.make_tiny_qwen2_5_omni import SPEAKER

pytestmark = [pytest.mark.engine, pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
STAGE = {"dtype": "float32", "max_model_len": 128}
OVERRIDES = {"0": STAGE | {"limit_mm_per_prompt": {"image": 0, "video": 0, "audio": 1}}, "1": STAGE}


@pytest.fixture(scope="module")
def server(tiny_omni_assets, tmp_path_factory):
    port = free_port()
    cmd = serve_command(
        tiny_omni_assets.model_dir,
        port,
        "--pipeline",
        "qwen2_5_omni",
        "--stage-overrides",
        json.dumps(OVERRIDES),
        "--served-model-name",
        "tiny-omni",
    )
    log = tmp_path_factory.mktemp("serve_omni_log") / "server.log"
    srv = start_server(cmd, port, log, server_env())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)


def _audio_chat(client, voice=SPEAKER, seed=7):
    return client.chat.completions.create(
        model="tiny-omni",
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio={"voice": voice, "format": "wav"},
        max_tokens=6,
        temperature=0,
        seed=seed,
    )


def _assert_spoken(audio) -> None:
    """``message.audio`` holds a mono 16-bit 24 kHz WAV that is not silent."""
    with wave.open(io.BytesIO(base64.b64decode(audio.data))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        frames = w.readframes(w.getnframes())
    assert len(frames) > 0 and frames != b"\x00" * len(frames)


def test_openai_client_reads_audio_and_its_transcript(client):
    text_only = client.chat.completions.create(
        model="tiny-omni", messages=MESSAGES, max_tokens=6, temperature=0
    )
    message = text_only.choices[0].message
    assert message.audio is None and message.content

    reply = _audio_chat(client)
    audio = reply.choices[0].message.audio
    assert reply.choices[0].message.content is None
    assert audio.transcript == message.content  # greedy thinker: the same text
    assert audio.id.startswith("audio_") and audio.expires_at > reply.created
    _assert_spoken(audio)
    assert _audio_chat(client).choices[0].message.audio.data == audio.data  # seeded talker and DiT


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"modalities": ["text", "audio"], "audio": {"voice": "nobody", "format": "wav"}}, "audio.voice"),
        ({"modalities": ["text", "audio"], "audio": {"voice": SPEAKER, "format": "mp3"}}, "audio.format"),
        ({"modalities": ["text", "audio"]}, "audio"),
        (
            {"modalities": ["text", "audio"], "audio": {"voice": SPEAKER, "format": "wav"}, "stream": True},
            "stream",
        ),
    ],
)
def test_bad_audio_fields_are_400_naming_the_field(server, fields, param):
    body = {"model": "tiny-omni", "messages": MESSAGES, "max_tokens": 4} | fields
    err = assert_openai_error(HTTP.post(server.url("/v1/chat/completions"), json=body, timeout=600), (400,))
    assert err["param"] == param


def test_min_tokens_acts_on_the_thinker_only(client):
    """Issue 21 rule 8 through the server and the official client: ``min_tokens`` (with
    ``max_tokens``) describes the thinker's text; it never reaches the talker's one-token steps (it
    died there with vLLM's ``min_tokens must be less than or equal to max_tokens=1``). The audio
    reply's transcript is the text-only reply's 12 tokens."""
    kw = dict(
        model="tiny-omni", messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"min_tokens": 12}
    )
    text = client.chat.completions.create(**kw)
    assert text.usage.completion_tokens == 12 and text.choices[0].finish_reason == "length"
    reply = client.chat.completions.create(
        **kw, modalities=["text", "audio"], audio={"voice": SPEAKER, "format": "wav"}, seed=7
    )
    audio = reply.choices[0].message.audio
    assert audio.transcript == text.choices[0].message.content
    _assert_spoken(audio)


AUDIO_QUESTION = "What is it?"
N = 6


def _audio_messages(*parts):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": AUDIO_QUESTION}]}]


def test_input_audio_equals_transformers_thinker(client, tiny_omni_assets):
    """The openai client sends a 1 s 16 kHz WAV and a question: the prompt (the tiny checkpoint's
    string template: the placeholder, a newline, the text) expands to transformers' input ids and the
    greedy tokens equal transformers' thinker fed the Whisper features of the WAV's samples; streamed, the
    same text."""
    import numpy as np
    from transformers import AutoTokenizer

    from tests.omni.omni_reference import qwen2_5_omni_audio_inputs, sine_noise_clip, thinker_greedy_from

    clip = sine_noise_clip()
    reply = client.chat.completions.create(
        model="tiny-omni",
        messages=_audio_messages(input_audio_part(clip)),
        modalities=["text"],
        max_tokens=N,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    pcm = np.round(clip * 32767).astype(np.int16).astype(np.float32) / 32768  # what the WAV holds
    after = f"\n{AUDIO_QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    inputs = qwen2_5_omni_audio_inputs(tiny_omni_assets.model_dir, "<|im_start|>user\n", after, pcm)
    tokens = thinker_greedy_from(tiny_omni_assets.model_dir, inputs, N)
    assert reply.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert reply.choices[0].token_ids == tokens
    text = AutoTokenizer.from_pretrained(tiny_omni_assets.model_dir).decode(tokens, skip_special_tokens=True)
    assert reply.choices[0].message.content == text.rstrip("\ufffd")  # vLLM holds back a partial character
    assert reply.usage.prompt_tokens == len(reply.prompt_token_ids)
    streamed = client.chat.completions.create(
        model="tiny-omni",
        messages=_audio_messages(input_audio_part(clip)),
        modalities=["text"],
        max_tokens=N,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == reply.choices[0].message.content
    )


def test_bad_input_audio_is_400_naming_the_part(server):
    """Each bad part is refused naming ``messages[0].content[j]`` (and the rate, the format);
    then the same clip is answered."""
    from tests.omni.omni_reference import sine_noise_clip

    clip = sine_noise_clip()
    good = input_audio_part(clip)
    not_wav = {"type": "input_audio", "input_audio": {"data": "aGVsbG8=", "format": "wav"}}
    cases = [
        (_audio_messages({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}), "base64"),
        (_audio_messages(input_audio_part(clip, fmt="mp3")), "'mp3' cannot be decoded"),
        (_audio_messages(not_wav), "not a WAV file"),
        (_audio_messages(input_audio_part(clip[::2], rate=8000)), "sample rate 8000 Hz: .*16000 Hz"),
        (_audio_messages(good, input_audio_part(clip[:8000])), "2 audio parts; .* at most 1"),
    ]
    url = server.url("/v1/chat/completions")
    for j, (messages, message) in enumerate(cases):
        body = {"model": "tiny-omni", "messages": messages, "max_tokens": 2, "modalities": ["text"]}
        err = assert_openai_error(HTTP.post(url, json=body, timeout=600), (400,))
        part = "messages[0].content[1]" if j == len(cases) - 1 else "messages[0].content[0]"
        assert err["param"] == part and err["message"].startswith(part + ": ")
        assert re.search(message, err["message"]), err["message"]
    body = {"model": "tiny-omni", "messages": _audio_messages(good), "max_tokens": 2, "modalities": ["text"]}
    ok = HTTP.post(url, json=body, timeout=600)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_input_audio_with_speech_out(client):
    """Audio in, speech out: the talker reads the thinker's hidden states of the audio positions (its
    own pass), so the reply is spoken; the transcript is the text-only reply (greedy thinker)."""
    from tests.omni.omni_reference import sine_noise_clip

    kw = dict(
        model="tiny-omni",
        messages=_audio_messages(input_audio_part(sine_noise_clip())),
        max_tokens=N,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = client.chat.completions.create(**kw, modalities=["text"])
    reply = client.chat.completions.create(
        **kw, modalities=["text", "audio"], audio={"voice": SPEAKER, "format": "wav"}, seed=7
    )
    audio = reply.choices[0].message.audio
    assert audio.transcript == text.choices[0].message.content
    _assert_spoken(audio)
