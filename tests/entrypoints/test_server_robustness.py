"""A live server on the shipped demo model (issue 13, items 6, 7 and 11).

- item 6: the ``openai`` client's default image call works (the model's own default size), a size
  the model cannot make is a 400 naming the limit, and a bad request among good concurrent ones
  fails alone;
- item 7: bad bytes (lone surrogates, 401-digit numbers) and odd adapter folders are 400s, and a
  bounded hypothesis fuzz of every field of every JSON route never gets a status >= 500 while the
  server keeps answering ``/health``;
- item 11: adapter names and served model names are one namespace, listed once each by
  ``/v1/models``, with ``model`` routing to what is listed.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from PIL import Image

from tests.entrypoints.route_strategies import ROUTES, fuzz_edits, fuzz_routes, post
from tests.entrypoints.server_utils import (
    HTTP,
    REPO_ROOT,
    assert_openai_error,
    copy_adapter,
    decode_png,
    free_port,
    serve_command,
    server_env,
    start_server,
)

DEMO = REPO_ROOT / "examples" / "demo_model"
GEN = {"num_inference_steps": 3, "guidance_scale": 3.0, "seed": 11}
GOOD = [
    "a red circle",
    "a blue square",
    "a green triangle",
    "a yellow circle",
    "a red square",
    "a blue circle",
]
pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("robust") / "loras"
    root.mkdir()
    copy_adapter(DEMO / "adapters" / "stripes", root / "stripes")
    odd = root / "odd"  # a layout we do not read: the config beside a differently named weights file
    odd.mkdir()
    (odd / "adapter_config.json").write_bytes(
        (DEMO / "adapters" / "warm" / "adapter_config.json").read_bytes()
    )
    (odd / "weights.safetensors").write_bytes(b"not really safetensors")
    return root


@pytest.fixture(scope="module")
def server(loras, tmp_path_factory):
    port = free_port()
    cmd = serve_command(
        str(DEMO),
        port,
        "--served-model-name",
        "demo",
        "demo-alias",
        "--dtype",
        "float32",
        "--lora-modules",
        f"warm={DEMO / 'adapters' / 'warm'}",
        "--lora-path",
        str(DEMO / "adapters" / "stripes"),
        "--lora-dirs",
        str(loras),
    )
    log = tmp_path_factory.mktemp("robust_log") / "server.log"
    srv = start_server(cmd, port, log, server_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)


decode = decode_png


def image(server, prompt: str, **fields) -> np.ndarray:
    r = post(server, "/v1/images/generations", {"prompt": prompt, "size": "64x64", **GEN, **fields})
    assert r.status_code == 200, r.text[:300]
    return decode(r.json()["data"][0]["b64_json"])


# ------------------------------------------------------------------ item 6
def test_openai_default_image_call_uses_the_models_default_size(client):
    result = client.images.generate(model="demo", prompt="a red circle")
    assert Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).size == (64, 64)


def test_a_size_the_model_cannot_make_is_a_400_naming_the_limit(server):
    err = assert_openai_error(
        post(server, "/v1/images/generations", {"prompt": "x", "size": "1024x1024"}), (400,)
    )
    assert "512" in err["message"] and "height" in err["message"]


def test_one_bad_request_among_good_concurrent_ones_fails_alone(server):
    alone = {p: image(server, p) for p in GOOD}
    long_prompt = " ".join(["a red circle beside a blue square under a green triangle"] * 10)
    bodies = [{"prompt": p, "size": "64x64", **GEN} for p in GOOD]
    bodies.insert(3, {"prompt": "a red circle", "size": "1024x1024", **GEN})
    bodies.append({"prompt": long_prompt, "size": "64x64", **GEN})
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: post(server, "/v1/images/generations", b), bodies))
    assert_openai_error(replies.pop(3), (400,))
    assert replies.pop().status_code == 200  # the over-long prompt is truncated (with a warning)
    for prompt, reply in zip(GOOD, replies, strict=True):
        assert reply.status_code == 200, reply.text[:300]
        assert np.abs(decode(reply.json()["data"][0]["b64_json"]) - alone[prompt]).max() <= 1


# ------------------------------------------------------------------ item 7
@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/images/generations", {"prompt": "a", "size": "64x64", "lora": {"name": "\ud800"}}),
        ("/v1/images/generations", {"prompt": "a", "size": "64x64", "lora": {"path": "/tmp/\ud800"}}),
        ("/v1/images/generations", {"prompt": "a", "model": "\ud800"}),
        ("/v1/images/generations", {"prompt": "\ud800 a red circle", "size": "64x64"}),
        (
            "/v1/images/generations",
            {"prompt": "a", "size": "64x64", "lora": {"name": "warm", "scale": 10**400}},
        ),
        ("/v1/images/generations", {"prompt": "a", "guidance_scale": 10**400}),
        ("/v1/load_lora_adapter", {"lora_name": "\ud800", "lora_path": "/tmp/x"}),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp/\ud800"}),
        ("/v1/unload_lora_adapter", {"lora_name": "\udfff"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
    ],
)
def test_bad_bytes_and_huge_numbers_are_400(server, route, body):
    err = assert_openai_error(post(server, route, body), (400, 404))
    assert err["message"]


@pytest.mark.parametrize("leaf", ["", "weights.safetensors"])
def test_an_unreadable_adapter_layout_is_400_on_generation_and_on_load(server, loras, leaf):
    path = str(loras / "odd" / leaf) if leaf else str(loras / "odd")
    gen = {"prompt": "a", "size": "64x64", **GEN, "lora": {"path": path}}
    assert_openai_error(post(server, "/v1/images/generations", gen), (400,))
    assert_openai_error(
        post(server, "/v1/load_lora_adapter", {"lora_name": "odd", "lora_path": path}), (400,)
    )
    assert "odd" not in {m["id"] for m in HTTP.get(server.url("/v1/models")).json()["data"]}


def test_fuzz_every_route_never_500(server):
    fuzz_routes(server, list(ROUTES))
    fuzz_edits(server)
    assert server.alive()
    names = [m["id"] for m in HTTP.get(server.url("/v1/models")).json()["data"]]
    assert len(names) == len(set(names))


# ------------------------------------------------------------------ item 11
def test_models_lists_each_name_once_and_model_routes_to_it(server):
    cards = HTTP.get(server.url("/v1/models")).json()["data"]
    ids = [c["id"] for c in cards]
    assert len(ids) == len(set(ids))
    assert {"demo", "demo-alias", "warm", "stripes"} <= set(ids)
    assert {c["id"]: c["parent"] for c in cards}["warm"] == "demo"
    base = image(server, "a blue square", model="demo")
    np.testing.assert_array_equal(image(server, "a blue square", model="demo-alias"), base)
    assert np.abs(image(server, "a blue square", model="warm") - base).max() > 8


@pytest.mark.parametrize("name", ["demo", "demo-alias", "warm", "stripes"])
def test_runtime_load_refuses_a_taken_name(server, loras, name):
    before = HTTP.get(server.url("/v1/models")).json()["data"]
    body = {"lora_name": name, "lora_path": str(loras / "stripes")}
    err = assert_openai_error(post(server, "/v1/load_lora_adapter", body), (400,))
    assert name in err["message"] and err["param"] == "lora_name"
    assert HTTP.get(server.url("/v1/models")).json()["data"] == before


@pytest.mark.parametrize("name", ["demo", "demo-alias", "warm"])
def test_a_request_path_may_not_take_a_taken_name(server, loras, name):
    body = {"prompt": "a", "size": "64x64", **GEN, "lora": {"name": name, "path": str(loras / "stripes")}}
    err = assert_openai_error(post(server, "/v1/images/generations", body), (400,))
    assert name in err["message"]


def test_a_request_path_may_repeat_its_own_adapters_name(server):
    body = {"name": "warm", "path": str(DEMO / "adapters" / "warm")}
    np.testing.assert_array_equal(
        image(server, "a red circle", lora=body), image(server, "a red circle", model="warm")
    )
