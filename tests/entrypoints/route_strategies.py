"""Hypothesis strategies for whole request bodies of every JSON route (mostly malformed values).

Each route's body holds its required fields and any subset of the others; a field usually takes a
value of the right kind (kept small, so that valid bodies stay cheap to run) and one time in four
anything JSON can carry: wrong types, huge integers, lone surrogates (``"\\ud800"``), deep or empty
containers.
Bodies are sent as ASCII JSON (``json.dumps``), so a lone surrogate travels as its escape.
"""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.entrypoints.lora_strategies import json_values, lora_values
from tests.entrypoints.server_utils import HTTP, assert_openai_error

odd_text = st.sampled_from(["\ud800", "a\udfffb", "\x00", "", " ", "é", "🙂", "../..", "%s%n", "x" * 300])
text = st.text(max_size=20) | odd_text
big_ints = st.integers(min_value=-(10**401), max_value=10**401)
anything = json_values | odd_text | big_ints | st.floats()


def field(valid, wrong=anything) -> st.SearchStrategy:
    """A field's value: usually ``valid`` (so bodies reach the engine), one time in four ``wrong``."""
    return st.integers(0, 3).flatmap(lambda k: wrong if k == 0 else valid)


def ints(lo: int, hi: int) -> st.SearchStrategy:
    return field(st.integers(min_value=lo, max_value=hi))


def _fields(required=None, **optional) -> st.SearchStrategy[dict]:
    """Bodies with ``required`` fields, any subset of ``optional`` ones and now and then an unknown key."""
    return st.fixed_dictionaries(required or {}, optional={**optional, "unknown_key": anything})


def _diffusion_fields(**extra):
    sides = st.sampled_from([16, 32, 48, 64]) | st.integers(min_value=-16, max_value=600)
    return dict(
        model=field(
            st.sampled_from(["demo", "demo-alias", "warm", "stripes", "tiny", "a", "nope", "\ud800"])
        ),
        size=field(
            st.sampled_from(["64x64", "32x48", "1024x1024", "16x16", "0x0", "64x", "auto", "\ud800x1"])
        ),
        height=field(sides),
        width=field(sides),
        num_inference_steps=ints(-1, 3),
        guidance_scale=field(st.floats(min_value=-1, max_value=200)),
        negative_prompt=field(text),
        seed=ints(-1, 2**64),
        num_frames=ints(-1, 4),
        lora=field(
            lora_values() | st.fixed_dictionaries({"name": st.just("warm"), "scale": big_ints | st.floats()})
        ),
        **extra,
    )


def _messages():
    part = st.fixed_dictionaries(
        {"type": field(st.sampled_from(["text", "image_url"]))},
        optional={"text": field(text), "image_url": anything},
    )
    message = st.fixed_dictionaries(
        {"role": field(st.sampled_from(["user", "system", "assistant", "bot"]))},
        optional={"content": field(text | st.lists(part, max_size=3)), "name": field(text)},
    )
    return field(st.lists(message, min_size=1, max_size=3))


def _sampling_fields():
    return dict(
        max_tokens=ints(-1, 4),
        temperature=field(st.floats(min_value=-1, max_value=3)),
        top_p=field(st.floats(min_value=-0.5, max_value=1.5)),
        top_k=ints(-2, 50),
        n=ints(-1, 3),
        stop=field(text),
        stream=field(st.booleans()),
        logprobs=anything,
    )


_prompt = field(st.sampled_from(["a red circle", "a blue square", "hi"]) | text)
ROUTES = {
    "/v1/images/generations": _fields(
        {"prompt": _prompt},
        n=ints(-1, 2),
        response_format=field(st.sampled_from(["b64_json", "url"])),
        **_diffusion_fields(),
    ),
    "/v1/videos/generations": _fields(
        {"prompt": _prompt}, fps=ints(-1, 200), video_format=anything, **_diffusion_fields()
    ),
    "/v1/chat/completions": _fields({"messages": _messages()}, **_sampling_fields(), **_diffusion_fields()),
    "/v1/completions": _fields(
        {"prompt": field(_prompt | st.lists(st.integers(-1, 10), max_size=4))},
        echo=anything,
        **_sampling_fields(),
        **_diffusion_fields(),
    ),
    "/v1/load_lora_adapter": _fields(
        {
            "lora_name": field(st.sampled_from(["demo", "demo-alias", "warm", "tiny", "a", "fuzzed"]) | text),
            "lora_path": field(
                st.sampled_from(["/", "/etc/passwd", "a/b", "hf://x/y", "/tmp/\ud800"]) | text
            ),
        },
        load_inplace=field(st.booleans()),
    ),
    "/v1/unload_lora_adapter": _fields(
        {"lora_name": field(st.sampled_from(["fuzzed", "nope"]) | text)}, lora_int_id=anything
    ),
}


def body_for(route: str) -> st.SearchStrategy:
    """A body of ``route`` (now and then not an object at all)."""
    return field(ROUTES[route])


def post(server, route: str, body, timeout: float = 300) -> httpx.Response:
    """POST ``body`` as ASCII JSON (a lone surrogate travels as its ``\\ud800`` escape)."""
    return HTTP.post(
        server.url(route),
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=timeout,
    )


def fuzz_routes(server, routes, max_examples: int = 40) -> None:
    """Every field of every route in ``routes`` fuzzed: no status >= 500, the server keeps answering."""
    for route in routes:
        _route_fuzzer(server, route, max_examples)()
        assert HTTP.get(server.url("/health"), timeout=300).status_code == 200, route


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
        r = post(server, route, body, timeout=600)
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
        r = HTTP.post(server.url("/v1/images/edits"), files=files, timeout=600)
        assert r.status_code < 500, (fields, r.text[:300])
        if r.status_code >= 400:
            assert_openai_error(r, (400, 404, 413, 415, 422))

    check()
    assert HTTP.get(server.url("/health"), timeout=300).status_code == 200


# ------------------------------------------------------------ hostile strings in every string field
#: A smallest body of each JSON route (what it requires), and the string fields it takes, nested
#: places spelled ``lora.path`` / ``messages[0].content``.
MINIMAL_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/images/generations": {"prompt": "a red circle", "num_inference_steps": 1, "size": "32x32"},
    "/v1/videos/generations": {"prompt": "a red circle", "num_inference_steps": 1, "num_frames": 1},
    "/v1/load_lora_adapter": {"lora_name": "fuzzed", "lora_path": "/nonexistent"},
    "/v1/unload_lora_adapter": {"lora_name": "fuzzed"},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1]},
}
_SAMPLING_STRINGS = ["model", "stop", "lora.name", "lora.path", "response_format.type"]
_DIFFUSION_STRINGS = ["model", "size", "negative_prompt", "lora.name", "lora.path"]
STRING_FIELDS = {
    "/v1/chat/completions": [
        "messages[0].content",
        "messages[0].name",
        "messages[0].role",
        *_SAMPLING_STRINGS,
    ],
    "/v1/completions": ["prompt", *_SAMPLING_STRINGS],
    "/v1/images/generations": ["prompt", "output_format", *_DIFFUSION_STRINGS],
    "/v1/videos/generations": ["prompt", "video_format", "input_reference", *_DIFFUSION_STRINGS],
    "/v1/load_lora_adapter": ["lora_name", "lora_path", "denoiser"],
    "/v1/unload_lora_adapter": ["lora_name"],
    "/tokenize": ["prompt", "model"],
    "/detokenize": ["model"],
}
#: (label, value): JSON text of a string value (non-UTF-8 bytes cannot be a str: they go in raw)
HOSTILE_STRINGS = [
    ("nul", json.dumps("a\x00b").encode()),
    ("control", json.dumps("a\x01\x1b[31m\x7fb\n").encode()),
    ("1MB", json.dumps("x" * (1 << 20)).encode()),
    ("non-utf8", b'"a\xff\xfeb\xc0"'),
]
_MARK = "@@HOSTILE@@"


def _with_value(body: dict, place: str) -> dict:
    """``body`` with the string at ``place`` (``a.b`` / ``a[0].b``) set to a marker."""
    body = json.loads(json.dumps(body))
    keys = place.replace("[0]", ".0").split(".")
    target = body
    for key in keys[:-1]:
        if key == "0":
            target = target[0]
        else:
            target = target.setdefault(key, {})
    target[keys[-1]] = _MARK
    return body


def fuzz_string_fields(server, routes) -> list[tuple[str, str, str, int]]:
    """POST every route of ``routes`` x string field x hostile value (:data:`HOSTILE_STRINGS`) as raw
    JSON; no answer >= 500, every 4xx an OpenAI error. Returns ``(route, field, label, status, response)``."""
    seen = []
    for route in routes:
        for place in STRING_FIELDS[route]:
            template = json.dumps(_with_value(MINIMAL_BODIES[route], place)).encode()
            for label, value in HOSTILE_STRINGS:
                content = template.replace(json.dumps(_MARK).encode(), value)
                r = HTTP.post(server.url(route), content=content, headers={"content-type": "application/json"},
                              timeout=600)  # fmt: skip
                assert r.status_code < 500, (route, place, label, r.text[:300])
                if r.status_code >= 400:
                    assert_openai_error(r, (400, 404, 413, 422))
                seen.append((route, place, label, r.status_code, r))
    return seen
