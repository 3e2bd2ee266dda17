"""Hypothesis strategies for whole request bodies of every JSON route (mostly malformed values).

Each route's body draws any subset of its fields; every field takes a value of the right kind
(kept small, so that a body that happens to be valid stays cheap to run) or anything JSON can
carry: wrong types, huge integers, lone surrogates (``"\\ud800"``), deep or empty containers.
Bodies are sent as ASCII JSON (``json.dumps``), so a lone surrogate travels as its escape.
"""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.entrypoints.lora_strategies import json_values, lora_values
from tests.entrypoints.server_utils import assert_openai_error

odd_text = st.sampled_from(["\ud800", "a\udfffb", "\x00", "", " ", "é", "🙂", "../..", "%s%n", "x" * 300])
text = st.text(max_size=20) | odd_text
big_ints = st.integers(min_value=-(10**401), max_value=10**401)
anything = json_values | odd_text | big_ints | st.floats()


def small_ints(lo: int, hi: int):
    return st.integers(min_value=lo, max_value=hi) | anything


def _fields(**fields) -> st.SearchStrategy[dict]:
    """Bodies holding any subset of ``fields``, plus now and then a key no route knows."""
    return st.fixed_dictionaries({}, optional={**fields, "unknown_key": anything})


def _diffusion_fields(**extra):
    return dict(
        model=st.sampled_from(["demo", "demo-alias", "warm", "nope", "\ud800"]) | anything,
        size=st.sampled_from(["64x64", "32x48", "1024x1024", "16x16", "0x0", "64x", "auto", "\ud800x1"])
        | anything,
        height=small_ints(-16, 600),
        width=small_ints(-16, 600),
        num_inference_steps=small_ints(-2, 3),
        guidance_scale=st.floats(min_value=-1, max_value=200) | anything,
        negative_prompt=text | anything,
        seed=small_ints(-1, 2**64),
        num_frames=small_ints(-1, 4),
        lora=lora_values()
        | st.fixed_dictionaries({"name": st.just("warm"), "scale": big_ints | st.floats()}),
        **extra,
    )


def _messages():
    part = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "\ud800"]) | anything},
        optional={"text": text | anything, "image_url": anything},
    )
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "bot"]) | anything},
        optional={"content": text | st.lists(part, max_size=3) | anything, "name": text | anything},
    )
    return st.lists(message, max_size=3) | anything


def _sampling_fields():
    return dict(
        max_tokens=small_ints(-1, 4),
        temperature=st.floats(min_value=-1, max_value=3) | anything,
        top_p=anything,
        top_k=anything,
        n=small_ints(-1, 3),
        stop=text | anything,
        stream=st.booleans() | anything,
        logprobs=anything,
    )


ROUTES = {
    "/v1/images/generations": _fields(
        prompt=st.sampled_from(["a red circle", "a blue square"]) | text | anything,
        n=small_ints(-1, 2),
        response_format=st.sampled_from(["b64_json", "url"]) | anything,
        **_diffusion_fields(),
    ),
    "/v1/videos/generations": _fields(
        prompt=text | anything, fps=small_ints(-1, 200), video_format=anything, **_diffusion_fields()
    ),
    "/v1/chat/completions": _fields(messages=_messages(), **_sampling_fields(), **_diffusion_fields()),
    "/v1/completions": _fields(
        prompt=text | st.lists(small_ints(-1, 10), max_size=4) | anything,
        echo=anything,
        **_sampling_fields(),
        **_diffusion_fields(),
    ),
    "/v1/load_lora_adapter": _fields(
        lora_name=st.sampled_from(["demo", "demo-alias", "warm", "fuzzed"]) | text | anything,
        lora_path=st.sampled_from(["/", "/etc/passwd", "a/b", "hf://x/y", "/tmp/\ud800"]) | text | anything,
        load_inplace=st.booleans() | anything,
    ),
    "/v1/unload_lora_adapter": _fields(
        lora_name=st.sampled_from(["fuzzed", "nope"]) | text | anything, lora_int_id=anything
    ),
}


def body_for(route: str) -> st.SearchStrategy:
    """A body of ``route`` (now and then not an object at all)."""
    return ROUTES[route] | anything


def post(server, route: str, body, timeout: float = 300) -> httpx.Response:
    """POST ``body`` as ASCII JSON (a lone surrogate travels as its ``\\ud800`` escape)."""
    return httpx.post(
        server.url(route),
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=timeout,
    )


def fuzz_routes(server, routes, max_examples: int = 40) -> None:
    """Every field of every route in ``routes`` fuzzed: no status >= 500, the server keeps answering."""
    for route in routes:
        _route_fuzzer(server, route, max_examples)()
        assert httpx.get(server.url("/health"), timeout=10).status_code == 200, route


def _route_fuzzer(server, route: str, max_examples: int):
    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body_for(route))
    def check(body):
        r = post(server, route, body, timeout=120)
        assert r.status_code < 500, (route, body, r.text[:300])
        if r.status_code >= 400:
            assert_openai_error(r, (400, 404, 413, 415, 422))

    return check


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


_form_value = (
    st.binary(max_size=24)
    | st.sampled_from(
        [b"\xff\xfe", b"\xed\xa0\x80", b'{"name": "\\ud800"}', b"64x64", b"3", b"-1", b"9" * 401]
    )
    | text.filter(lambda t: "\x00" not in t).map(lambda t: t.encode("utf-8", "surrogatepass"))
)
FORM_KEYS = ["prompt", "size", "n", "lora", "model", "seed", "num_inference_steps", "guidance_scale", "x"]


def edit_forms():
    """``(fields, image bytes)`` of a multipart ``/v1/images/edits`` body (bytes, often not UTF-8)."""
    image = st.sampled_from([_png(), b"", b"\x89PNG\r\n\x1a\n", b"GIF89a"]) | st.binary(max_size=64)
    return st.tuples(st.dictionaries(st.sampled_from(FORM_KEYS), _form_value, max_size=6), image)


def fuzz_edits(server, max_examples: int = 40) -> None:
    """``/v1/images/edits`` with fuzzed multipart fields and image: no status >= 500."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(edit_forms())
    def check(form):
        fields, image = form
        files = {key: (None, value) for key, value in fields.items()}
        files["image"] = ("in.png", image, "image/png")
        r = httpx.post(server.url("/v1/images/edits"), files=files, timeout=120)
        assert r.status_code < 500, (fields, r.text[:300])
        if r.status_code >= 400:
            assert_openai_error(r, (400, 404, 413, 415, 422))

    check()
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
