"""`vllm serve <tiny LLM> --omni`: a real server process driven by the official openai client.

One server for the module, started through vLLM's own ``vllm`` console script (which hands
``--omni`` argv to ``vllm_omni.entrypoints.cli.main``). Outputs are checked token for token
against transformers+peft greedy decoding (tests/llm_reference.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.entrypoints.server_utils import (
    HTTP,
    REPO_ROOT,
    assert_openai_error,
    console_script,
    copy_adapter,
    free_port,
    input_audio_part,
    server_env,
    start_server,
)
from tests.llm_reference import hf_greedy
from tests.waiting import load_stretch

N = 8
PROMPT = "hello world"
pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def paths(tiny_llm_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_llm")
    root = tmp / "loras"
    root.mkdir()
    outside = tmp / "outside"
    outside.mkdir()
    p = {
        "model": tiny_llm_assets.model_dir,
        "a": tiny_llm_assets.adapter_a,
        "root": root,
        "b": copy_adapter(tiny_llm_assets.adapter_b, root / "b"),
        "a_copy": copy_adapter(tiny_llm_assets.adapter_a, root / "a_copy"),
        "b_copy": copy_adapter(tiny_llm_assets.adapter_b, root / "b_copy"),
        "rank64": copy_adapter(tiny_llm_assets.adapter_rank64, root / "rank64"),
        "outside_a": copy_adapter(tiny_llm_assets.adapter_a, outside / "a"),
        "outside_missing": outside / "missing",
    }
    pickled = root / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_llm_assets.adapter_a / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    p["pickled"] = pickled
    (root / "escape").symlink_to(p["outside_a"], target_is_directory=True)
    p["escape"] = root / "escape"
    odd = root / "odd"  # a layout we do not read: the config beside a differently named weights file
    odd.mkdir()
    shutil.copy(tiny_llm_assets.adapter_a / "adapter_config.json", odd)
    shutil.copy(tiny_llm_assets.adapter_a / "adapter_model.safetensors", odd / "weights.safetensors")
    p["odd"] = odd
    return p


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    port = free_port()
    cmd = console_script("vllm") + [
        "serve",
        str(paths["model"]),
        "--omni",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--max-loras",
        "2",
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "8",
        "--lora-modules",
        f"a={paths['a']}",
        "--lora-dirs",
        str(paths["root"]),
        "--disable-uvicorn-access-log",
    ]
    log = tmp_path_factory.mktemp("serve_llm_log") / "server.log"
    srv = start_server(
        cmd, port, log, server_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_OMNI_MAX_REQUEST_BODY_MB="1")
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=600)


def ref(paths, prompt, adapter_key):
    return hf_greedy(paths["model"], prompt, N, None if adapter_key is None else paths[adapter_key])


def chat(client, model="tiny", lora=None, prompt=PROMPT):
    extra = {"ignore_eos": True, "return_token_ids": True}
    if lora is not None:
        extra["lora"] = lora
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=N,
        temperature=0.0,
        extra_body=extra,
    )
    return reply


def chat_tokens(reply):
    return reply.choices[0].token_ids, reply.prompt_token_ids


def completion_tokens(server, model="tiny", lora=None, prompt=PROMPT) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0.0, "ignore_eos": True}
    body["return_token_ids"] = True
    if lora is not None:
        body["lora"] = lora
    r = HTTP.post(server.url("/v1/completions"), json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_health_and_models_list_base_and_adapters(server, client):
    assert HTTP.get(server.url("/health")).status_code == 200
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {"tiny", "a"}
    assert models["a"].parent == "tiny" and models["tiny"].parent is None


@pytest.mark.parametrize(
    "model, lora, adapter",
    [
        ("tiny", None, None),
        ("a", None, "a"),  # --lora-modules adapter selected through `model`
        ("tiny", {"name": "b", "path": "B"}, "b"),  # request-time adapter inside --lora-dirs
        ("tiny", [{"lora_name": "b", "local_path": "B", "scale": 1.0}], "b"),
    ],
)
def test_chat_matches_transformers_peft(server, client, paths, model, lora, adapter):
    if lora is not None:
        lora = json.loads(json.dumps(lora).replace('"B"', json.dumps(str(paths["b"]))))
    tokens, prompt_ids = chat_tokens(chat(client, model, lora))
    # the prompt is the chat template rendered by the model's own tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(paths["model"]))
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    assert prompt_ids == tok.encode(text, add_special_tokens=False)
    assert tokens == ref(paths, prompt_ids, adapter)


def test_chat_streaming_returns_the_same_text(client):
    plain = chat(client, model="a")
    stream = client.chat.completions.create(
        model="a",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=N,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    pieces = [c for c in chunks if c.choices]
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == plain.choices[0].message.content
    # one piece per engine step as the stage produces it, not the finished answer in one chunk
    with_tokens = [c.choices[0].token_ids for c in pieces if getattr(c.choices[0], "token_ids", None)]
    assert len(with_tokens) == N and sum(with_tokens, []) == plain.choices[0].token_ids
    assert pieces[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    last = chunks[-1]  # stream_options.include_usage: usage, no choices
    assert last.choices == [] and last.usage.completion_tokens == N
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens


def test_completions_streaming_sends_pieces_as_they_are_generated(server, client):
    prompts = [PROMPT, "a second prompt"]
    plain = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=N, temperature=0.0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompts,
            max_tokens=N,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    assert {c.object for c in chunks} == {"text_completion"}
    for i, choice in enumerate(plain.choices):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == choice.text
        assert sum(1 for c in mine if c.token_ids) == N
        assert mine[-1].finish_reason == "length"
    # the first piece of a long answer arrives long before its end
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    start, stamps = time.monotonic(), []
    with HTTP.stream("POST", server.url("/v1/completions"), json=body, timeout=600) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic() - start)
    assert len(stamps) >= 100 and stamps[0] < stamps[-1] / 2, (stamps[0], stamps[-1])


def test_abandoned_requests_are_cancelled_without_tracebacks(server):
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 230, "temperature": 0.0, "ignore_eos": True}
    for _ in range(2):  # the second one, warm, alone: how long one long request takes
        start = time.monotonic()
        assert HTTP.post(server.url("/v1/completions"), json=long, timeout=600).status_code == 200
        full = time.monotonic() - start
    log_start = server.log_path.stat().st_size

    def leave_plain():  # the client gives up while the answer is generated
        with pytest.raises(httpx.TimeoutException):
            HTTP.post(server.url("/v1/completions"), json=long, timeout=full / 4)

    def leave_stream():  # the client reads one chunk (or gives up waiting for it), then goes away
        chat_body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True} | long
        with (
            contextlib.suppress(httpx.TimeoutException),
            HTTP.stream("POST", server.url("/v1/chat/completions"), json=chat_body, timeout=full / 4) as r,
        ):
            assert next(line for line in r.iter_lines() if line.startswith("data:"))

    # --max-num-seqs 8: if the 8 abandoned requests ran on, the next one would wait for a slot
    threads = [threading.Thread(target=f) for f in [leave_plain, leave_stream] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = time.monotonic()
    short = HTTP.post(server.url("/v1/completions"), json=long | {"max_tokens": 2}, timeout=600)
    waited = time.monotonic() - start
    assert short.status_code == 200
    assert waited < full, (waited, full)  # measured on main before the fix: 14.6 s against 1.0 s
    with open(server.log_path, "rb") as f:
        f.seek(log_start)
        assert b"Traceback" not in f.read()


def test_a_fifo_adapter_never_freezes_the_server(server, paths):
    fifo_dir = paths["root"] / "fifo"
    fifo_dir.mkdir(exist_ok=True)
    shutil.copy(paths["a"] / "adapter_config.json", fifo_dir)
    fifo = fifo_dir / "adapter_model.safetensors"
    if not fifo.exists():
        os.mkfifo(fifo)
    result = {}

    def post():
        result["r"] = _post_lora(server, {"name": "fifo", "path": str(fifo_dir)})

    worker = threading.Thread(target=post)
    worker.start()
    try:
        # progress, not time: nothing writes to the FIFO until the finally below, so a server that
        # opened it would stay frozen and never answer (the caps only bound a failing run)
        for _ in range(3):
            assert HTTP.get(server.url("/health"), timeout=600).status_code == 200
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
            assert HTTP.post(server.url("/v1/completions"), json=body, timeout=300).status_code == 200
    finally:
        deadline = time.monotonic() + 300
        while worker.is_alive() and time.monotonic() < deadline:  # a reader stuck on the FIFO: feed it
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                os.write(fd, b"not safetensors")
                os.close(fd)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: nobody has it open
                    raise
            worker.join(0.2)
    assert "regular file" in assert_openai_error(result["r"])["message"]


JSON_ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/images/generations",
    "/v1/videos/generations",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
]


#: JSON routes that also take a multipart upload (the video route's ``input_reference`` file)
MULTIPART_TOO = {"/v1/videos/generations"}
OTHER_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]


@pytest.mark.parametrize(
    ("content_type", "route"),
    [
        (t, r)
        for r in JSON_ROUTES
        for t in OTHER_TYPES
        if not (t == "multipart/form-data" and r in MULTIPART_TOO)
    ],
)
def test_json_routes_refuse_other_content_types(server, route, content_type):
    headers = {"content-type": content_type} if content_type else {}
    body = json.dumps({"lora_name": "a", "prompt": PROMPT, "messages": [{"role": "user", "content": "x"}]})
    r = HTTP.post(server.url(route), content=body.encode(), headers=headers, timeout=600)
    assert assert_openai_error(r, (415,))["type"] == "UnsupportedMediaTypeError"
    # a cross-site form post did not unload the start-up adapter
    assert "a" in {m["id"] for m in HTTP.get(server.url("/v1/models")).json()["data"]}


def test_json_with_a_charset_is_accepted(server):
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2}).encode()
    headers = {"content-type": "Application/JSON; charset=utf-8"}
    assert (
        HTTP.post(server.url("/v1/completions"), content=body, headers=headers, timeout=600).status_code
        == 200
    )


def test_completions_match_and_adapters_differ(server, paths):
    base = completion_tokens(server)
    with_b = completion_tokens(server, lora={"name": "b", "path": str(paths["b"])})
    assert base == ref(paths, PROMPT, None)
    assert with_b == ref(paths, PROMPT, "b")
    assert base != with_b


def test_peer_spellings_give_identical_text(client, paths):
    """``adapter`` (vllm-omni) and ``lora_name`` / ``local_path`` (vLLM) select the same adapter as
    ``name`` / ``path``, and ``lora_scale`` / ``weight`` 1.0 are ``scale`` 1.0: the same text and tokens."""
    b = str(paths["b"])
    canonical = chat(client, lora={"name": "b", "path": b, "scale": 1.0})
    for lora in (
        {"adapter": "b", "local_path": b, "lora_scale": 1.0},
        {"lora_name": "b", "path": b, "weight": 1.0},
    ):
        reply = chat(client, lora=lora)
        assert reply.choices[0].message.content == canonical.choices[0].message.content
        assert chat_tokens(reply) == chat_tokens(canonical)
    tokens, prompt_ids = chat_tokens(canonical)
    assert tokens == ref(paths, prompt_ids, "b")


def test_input_audio_to_a_text_model_is_400_naming_the_part(server, client, paths):
    """A text-only LLM takes no audio: the part is named; the next request still equals transformers."""
    content = [{"type": "text", "text": PROMPT}, input_audio_part([0.1] * 1600)]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    err = assert_openai_error(HTTP.post(server.url("/v1/chat/completions"), json=body, timeout=600), (400,))
    assert err["param"] == "messages[0].content[1]"
    assert err["message"] == "messages[0].content[1]: this model takes no audio input"
    tokens, prompt_ids = chat_tokens(chat(client))
    assert tokens == ref(paths, prompt_ids, None)


def test_unknown_model_is_404(client, server):
    with pytest.raises(openai.NotFoundError):
        chat(client, model="no-such-model")
    r = HTTP.post(server.url("/v1/completions"), json={"model": "nope", "prompt": "x"})
    assert assert_openai_error(r, (404,))["param"] == "model"


def test_same_name_other_path_never_reuses_weights(server, paths):
    first = completion_tokens(server, lora={"name": "x", "path": str(paths["b_copy"])})
    second = completion_tokens(server, lora={"name": "x", "path": str(paths["a_copy"])})
    assert first == ref(paths, PROMPT, "b") and second == ref(paths, PROMPT, "a")
    # an explicit int_id bound to one path cannot be pointed at other weights
    ok = completion_tokens(server, lora={"name": "y", "path": str(paths["b_copy"]), "int_id": 4242})
    assert ok == ref(paths, PROMPT, "b")
    r = HTTP.post(
        server.url("/v1/completions"),
        json={
            "prompt": PROMPT,
            "max_tokens": 2,
            "lora": {"name": "y", "path": str(paths["a_copy"]), "int_id": 4242},
        },
    )
    assert_openai_error(r)


def _post_lora(server, lora):
    return HTTP.post(server.url("/v1/completions"), json={"prompt": PROMPT, "max_tokens": 2, "lora": lora})


def test_paths_outside_lora_dirs_are_refused_without_revealing_existence(server, paths):
    existing = assert_openai_error(_post_lora(server, {"path": str(paths["outside_a"])}))
    missing = assert_openai_error(_post_lora(server, {"path": str(paths["outside_missing"])}))
    strip = lambda e, p: e["message"].replace(str(p), "<p>")  # noqa: E731
    assert strip(existing, paths["outside_a"]) == strip(missing, paths["outside_missing"])
    for path in (
        str(paths["root"]) + "/../outside/a",  # `..` out of the root
        str(paths["escape"]),  # symlink inside the root pointing out of it
        "outside/a",  # relative
        "some-org/some-lora",  # hub id: remote, not enabled
        "https://example.com/lora.safetensors",
    ):
        err = assert_openai_error(_post_lora(server, {"name": "z", "path": path}))
        assert err["param"] == "lora", path


def test_bad_adapters_fail_alone_and_server_keeps_serving(server, paths):
    err = assert_openai_error(_post_lora(server, {"path": str(paths["pickled"])}))
    assert "pickle" in err["message"]
    err = assert_openai_error(_post_lora(server, {"name": "big", "path": str(paths["rank64"])}))
    assert "rank" in err["message"].lower()
    cut = copy_adapter(paths["b"], paths["root"] / "cut")  # issue 46: a truncated weights file
    weights = cut / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    for response in (
        _post_lora(server, {"name": "cut", "path": str(cut)}),
        HTTP.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "cut", "lora_path": str(cut)}),
    ):
        message = assert_openai_error(response)["message"]
        assert str(weights) in message and "Stage 0" in message and "not a readable safetensors" in message
    assert completion_tokens(server, lora={"name": "b", "path": str(paths["b"])}) == ref(paths, PROMPT, "b")
    assert completion_tokens(server) == ref(paths, PROMPT, None)


def test_llm_stage_rejects_scales_and_several_adapters(server, paths):
    rule = "an LLM stage applies one adapter per request, at scale 1.0, with no denoiser"
    for entry in (
        {"path": str(paths["b"]), "scale": 0.5},
        {"path": str(paths["b"]), "denoiser": "transformer"},
    ):
        err = assert_openai_error(_post_lora(server, entry), (400,))
        assert rule in err["message"] and err["param"] == "lora", err
    both = [{"path": str(paths["b"])}, {"path": str(paths["a_copy"])}]
    assert "at most 1" in assert_openai_error(_post_lora(server, both))["message"]


def test_runtime_load_and_unload(server, client, paths):
    load = lambda body: HTTP.post(server.url("/v1/load_lora_adapter"), json=body, timeout=600)  # noqa: E731
    unload = lambda body: HTTP.post(server.url("/v1/unload_lora_adapter"), json=body, timeout=600)  # noqa: E731
    assert load({"lora_name": "b-rt", "lora_path": str(paths["b"])}).status_code == 200
    assert {m.id: m.parent for m in client.models.list().data}["b-rt"] == "tiny"
    assert (
        chat_tokens(chat(client, model="b-rt"))[0]
        == chat_tokens(chat(client, lora={"name": "b", "path": str(paths["b"])}))[0]
    )
    assert_openai_error(load({"lora_name": "b-rt", "lora_path": str(paths["b"])}))  # already loaded
    # the same files under a second name are a second adapter, as in vLLM (the path's id is taken)
    assert load({"lora_name": "b-rt2", "lora_path": str(paths["b"])}).status_code == 200
    assert {"b-rt", "b-rt2"} <= {m.id for m in client.models.list().data}
    assert chat_tokens(chat(client, model="b-rt2"))[0] == chat_tokens(chat(client, model="b-rt"))[0]
    assert unload({"lora_name": "b-rt2"}).status_code == 200
    assert chat(client, model="b-rt").model == "b-rt"
    assert_openai_error(load({"lora_name": "out", "lora_path": str(paths["outside_a"])}))  # not allowed
    assert_openai_error(load({"lora_name": "big", "lora_path": str(paths["rank64"])}))  # invalid adapter
    assert unload({"lora_name": "b-rt"}).status_code == 200
    assert "b-rt" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        chat(client, model="b-rt")
    assert_openai_error(unload({"lora_name": "b-rt"}), (404,))


def test_concurrent_unloads_and_loads_of_one_name_answer_as_a_serial_history(server, paths):
    """Issue 46: ten concurrent unloads of an adapter loaded once answer one 200 and nine 404 (they all
    answered 200); ten concurrent loads of one new name answer one 200 and nine 400 (already loaded)."""
    post = lambda route, body: HTTP.post(server.url(route), json=body, timeout=600).status_code  # noqa: E731
    load = {"lora_name": "once", "lora_path": str(paths["b"])}
    with ThreadPoolExecutor(10) as pool:
        loads = sorted(pool.map(lambda _: post("/v1/load_lora_adapter", load), range(10)))
        unloads = sorted(
            pool.map(lambda _: post("/v1/unload_lora_adapter", {"lora_name": "once"}), range(10))
        )
    assert loads == [200] + [400] * 9
    assert unloads == [200] + [404] * 9
    assert HTTP.get(server.url("/health")).status_code == 200


def test_concurrent_requests_with_different_adapters(server, client, paths):
    plan = [None, "a", "b", None, "b", "a"] * 2
    lora_b = {"name": "b", "path": str(paths["b"])}

    def one(key):
        if key == "a":
            return completion_tokens(server, model="a")
        return completion_tokens(server, lora=lora_b if key == "b" else None)

    with ThreadPoolExecutor(len(plan)) as pool:
        results = list(pool.map(one, plan))
    for key, tokens in zip(plan, results):
        assert tokens == ref(paths, PROMPT, key), key


MALFORMED = [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b""),
    ("/v1/chat/completions", b"[1, 2]"),
    ("/v1/completions", b'{"prompt": "x", "lora": ' + b"[" * 100000 + b"]" * 100000 + b"}"),
    ("/v1/chat/completions", {"model": "tiny"}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "lora": "b"}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "lora": {"name": 3, "path": "/x"}},
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "lora": {"path": "/x", "rank": 4}},
    ),
    ("/v1/completions", {"prompt": "x", "lora": {"path": "/x", "scale": "big"}}),
    ("/v1/completions", {"prompt": "x", "lora": {"path": "/x", "scale": 1e9}}),
    ("/v1/completions", b'{"prompt": "x", "lora": {"path": "/x", "scale": NaN}}'),
    ("/v1/completions", {"prompt": "x", "lora": {"path": "/x", "int_id": 0}}),
    ("/v1/completions", {"prompt": "x", "lora": {"path": "/x", "int_id": True}}),
    ("/v1/completions", {"prompt": "x", "lora": {"path": "/x\u0000y"}}),
    ("/v1/completions", {"prompt": "x", "lora": {"name": "a", "lora_name": "b"}}),
    ("/v1/completions", {"prompt": "x", "lora": [{"path": "/x"}] * 40}),
    ("/v1/completions", {"prompt": {"text": "x"}}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": "x" * 5000, "max_tokens": 1}),  # longer than max_model_len
    ("/v1/completions", {"prompt": "x", "stop": 5}),
    ("/v1/images/generations", {"prompt": "a fox", "size": "big"}),  # also: no image output here
    ("/v1/videos/generations", {"prompt": "a fox"}),
    ("/v1/load_lora_adapter", {"lora_name": "q"}),
    ("/v1/unload_lora_adapter", {}),
]


@pytest.mark.parametrize("route, body", MALFORMED, ids=[f"{r}-{i}" for i, (r, _) in enumerate(MALFORMED)])
def test_malformed_bodies_get_openai_errors(server, route, body):
    if isinstance(body, bytes):
        r = HTTP.post(server.url(route), content=body, headers={"content-type": "application/json"})
    else:
        r = HTTP.post(server.url(route), json=body, timeout=600)
    assert_openai_error(r)
    assert HTTP.get(server.url("/health")).status_code == 200


def test_examples_client_and_curl(server, paths):
    script = REPO_ROOT / "examples" / "online_serving" / "openai_client.py"
    base = [sys.executable, str(script), "--base-url", server.url("/v1"), "--max-tokens", "4"]
    out = subprocess.run(
        base + ["--lora-name", "b", "--lora-path", str(paths["b"])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "reply:" in out.stdout and '"parent": "tiny"' in out.stdout
    env = dict(os.environ, BASE_URL=server.base_url, MODEL="tiny", ADAPTER_PATH=str(paths["b"]))
    curl = REPO_ROOT / "examples" / "online_serving" / "curl_examples.sh"
    out = subprocess.run(["bash", str(curl)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    docs = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert len(docs) == 4 and not any("error" in d for d in docs), docs


def test_property_malformed_lora_never_500_on_the_live_server(server):
    from hypothesis import HealthCheck, given, settings

    from tests.entrypoints.lora_strategies import lora_values

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(lora_values())
    def check(lora):
        body = {"prompt": "hi", "max_tokens": 1, "lora": lora}
        r = HTTP.post(server.url("/v1/completions"), json=body, timeout=600)
        assert r.status_code < 500, (lora, r.text[:300])
        if r.status_code != 200:
            assert_openai_error(r, (400, 404, 422))

    check()
    assert HTTP.get(server.url("/health")).status_code == 200


@pytest.mark.parametrize("leaf", ["", "weights.safetensors"])
def test_an_unread_adapter_layout_is_400_on_generation_and_on_load(server, paths, leaf):
    """Issue 13 item 7: adapter_config.json beside weights.safetensors (not a PEFT folder)."""
    path = str(paths["odd"] / leaf) if leaf else str(paths["odd"])
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "lora": {"name": "odd", "path": path}}
    assert_openai_error(HTTP.post(server.url("/v1/completions"), json=body, timeout=600), (400,))
    load = {"lora_name": "odd", "lora_path": path}
    assert_openai_error(HTTP.post(server.url("/v1/load_lora_adapter"), json=load, timeout=600), (400,))
    assert HTTP.get(server.url("/health")).status_code == 200


def test_fuzz_every_route_never_500_on_the_llm_server(server):
    """Issue 13 item 7: every field of every JSON route, bounded (hypothesis, 40 bodies a route)."""
    from tests.entrypoints.route_strategies import ROUTES, fuzz_routes

    fuzz_routes(server, list(ROUTES))
    assert server.alive()


def test_oversized_bodies_are_413_and_the_server_keeps_serving(server):
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = HTTP.post(server.url("/v1/chat/completions"), json=big, timeout=600)
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"

    def chunks():  # no Content-Length: the streamed size is counted
        for _ in range(3):
            yield b"x" * (1 << 20)

    r = HTTP.post(
        server.url("/v1/completions"),
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=600,
    )
    assert r.status_code == 413
    assert HTTP.get(server.url("/health"), timeout=10).status_code == 200
    # greedy and ignore_eos: a sampled first token may be EOS, which would make the text empty by chance
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    ok = HTTP.post(server.url("/v1/completions"), json=body, timeout=600)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_huge_conversation_is_refused_before_tokenising_and_health_keeps_answering(server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello world " * 80_000}],
        "max_tokens": 2,
    }
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(r=HTTP.post(server.url("/v1/chat/completions"), json=body, timeout=600))
    )
    stretch = load_stretch()  # the bounds below hold on a quiet machine; scaled by this one's load
    start = time.monotonic()
    worker.start()
    while worker.is_alive():
        t0 = time.monotonic()
        assert HTTP.get(server.url("/health"), timeout=300).status_code == 200
        assert time.monotonic() - t0 < 1.5 * stretch
        worker.join(0.05)
    err = assert_openai_error(result["r"])
    assert err["param"] == "messages" and "context of 256 tokens" in err["message"]
    assert time.monotonic() - start < 10 * stretch


def test_the_server_shows_vllm_omni_info_logs(server):
    """`vllm serve --omni` shows our INFO records (e.g. the stage start-up, the CPU KV budget) as vLLM shows its own."""
    log = server.log_path.read_text(errors="replace")
    assert "[vllm_omni.engine.orchestrator] starting Stage 0 (llm_ar)" in log, server.log_tail()


def test_the_model_field_names_the_adapter_that_served(server, client, paths):
    """Issue 21, rule 5: ``model`` (and every stream chunk's) names the adapter however it was chosen."""
    assert chat(client).model == "tiny" and chat(client, model="a").model == "a"
    assert chat(client, lora={"name": "a"}).model == "a"
    by_path = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"lora": {"path": str(paths["b"])}}
    )
    assert by_path.model == str(paths["b"])  # a path without a registered name is named by the path
    named = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=2,
        extra_body={"lora": {"name": "bee", "path": str(paths["b"])}},
    )
    assert named.model == "bee"
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=3,
        stream=True,
        extra_body={"lora": {"name": "a"}},
    )
    assert {chunk.model for chunk in stream} == {"a"}
    stream = client.completions.create(model="a", prompt=PROMPT, max_tokens=3, stream=True)
    assert {chunk.model for chunk in stream} == {"a"}


def test_load_inplace_serves_the_new_weights_never_the_cached_prefix(server, client, paths):
    """Issue 21, rule 1 over HTTP: ``load_inplace`` of rewritten files; vLLM's prefix cache keys blocks by
    lora name and path, so a long prompt would reuse the old adapter's KV under an unversioned name."""
    folder = paths["root"] / "inplace"
    copy_adapter(paths["a"], folder)
    prompt = [10 + (i * 37) % 480 for i in range(240)]
    load = lambda body: HTTP.post(server.url("/v1/load_lora_adapter"), json=body, timeout=120)  # noqa: E731
    assert load({"lora_name": "ip", "lora_path": str(folder)}).status_code == 200
    try:
        assert completion_tokens(server, model="ip", prompt=prompt) == ref(paths, prompt, "a")
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(paths["b"] / name, folder / name)
        assert load({"lora_name": "ip", "lora_path": str(folder), "load_inplace": True}).status_code == 200
        assert completion_tokens(server, model="ip", prompt=prompt) == ref(paths, prompt, "b")
        assert [m.id for m in client.models.list().data].count("ip") == 1
    finally:
        HTTP.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "ip"}, timeout=60)


# ---------------------------------------------------------------- issue 49: logprobs, formats, tokens
def _token_text(tok, token_id: int) -> str:
    """A token's text as vLLM shows it: "" for a piece of a multi-byte character."""
    text = tok.decode([token_id])
    return "" if "\ufffd" in text else text


def _check_position(tok, ref_row, token_id, token, logprob, alternatives, k: int):
    """One generated position against transformers + peft (within 1e-4): the sampled token's text and
    value; the ``k`` most likely tokens' texts and values. ``alternatives``: chat's list of
    ``(text, value)``, or completions' ``{text: value}`` (one entry per text: the most likely's)."""
    assert token == _token_text(tok, token_id) and abs(logprob - float(ref_row[token_id])) < 1e-4
    values, ids = torch.topk(ref_row, k)
    expected = [(_token_text(tok, i), v) for i, v in zip(ids.tolist(), values.tolist())]
    if isinstance(alternatives, list):
        assert len(alternatives) == k
        assert [v for _, v in alternatives] == pytest.approx([v for _, v in expected], abs=1e-4)
        assert sorted(t for t, _ in alternatives) == sorted(t for t, _ in expected)
    else:
        for text, _ in expected:
            assert abs(alternatives[text] - max(v for t, v in expected if t == text)) < 1e-4, (
                text,
                alternatives,
            )


def test_logprobs_through_an_adapter_equal_transformers_peft(client, paths):
    """Issue 49: ``logprobs=True, top_logprobs=5`` (chat) and ``logprobs=5`` (completions), plain
    and streamed, through adapter ``a``: every value == transformers + peft within 1e-4 (fp32)."""
    from transformers import AutoTokenizer

    from tests.llm_reference import hf_logprobs

    tok = AutoTokenizer.from_pretrained(str(paths["model"]))
    common = dict(
        model="a", max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=5, **common)
    gen, prompt_ids = chat_tokens(reply)
    ref_rows = hf_logprobs(paths["model"], prompt_ids, gen, paths["a"])
    content = reply.choices[0].logprobs.content
    assert len(content) == len(gen) == 4
    for row, token_id, lp in zip(ref_rows, gen, content):
        alts = [(a.token, a.logprob) for a in lp.top_logprobs]
        assert lp.bytes == list(lp.token.encode())
        _check_position(tok, row, token_id, lp.token, lp.logprob, alts, 5)
    streamed = client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=5, stream=True, **common
    )
    pieces = [
        lp for c in streamed if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content
    ]
    assert [p.token for p in pieces] == [p.token for p in content]
    assert [p.logprob for p in pieces] == pytest.approx([p.logprob for p in content], abs=1e-5)

    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    comp = client.completions.create(prompt=PROMPT, logprobs=5, **common)
    gen = comp.choices[0].token_ids
    ref_rows = hf_logprobs(paths["model"], prompt_ids, gen, paths["a"])
    lp = comp.choices[0].logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for row, token_id, token, value, alts in zip(
        ref_rows, gen, lp.tokens, lp.token_logprobs, lp.top_logprobs
    ):
        assert token in alts and len(alts) <= 6  # the sampled token is always listed
        _check_position(tok, row, token_id, token, value, alts, 5)
    streamed = client.completions.create(prompt=PROMPT, logprobs=5, stream=True, **common)
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert sum((c.token_logprobs for c in chunks), []) == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert sum((c.text_offset for c in chunks), []) == lp.text_offset


def test_response_format_is_enforced_and_tools_are_refused(server, client):
    """Issue 49: ``response_format`` json_schema / json_object go through vLLM's structured outputs
    (the reply is valid for the schema); an invalid schema and ``tools`` are 400 naming the field."""
    import jsonschema

    schema = {"type": "string", "enum": ["yes", "no"]}  # short: a random model ends it within a few tokens
    messages = [{"role": "user", "content": PROMPT}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    reply = client.chat.completions.create(
        model="a", messages=messages, max_tokens=24, temperature=0.0, response_format=fmt
    )
    assert reply.choices[0].finish_reason == "stop", reply
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    reply = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert reply.choices[0].text.lstrip().startswith("{"), reply.choices[0].text
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    for field, value in (
        ("response_format", bad),
        ("response_format", {"type": "json_schema"}),
        ("response_format", {"type": "xml"}),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("top_logprobs", 50),
        ("top_logprobs", 2),  # without logprobs: true
    ):
        body = {"messages": messages, "max_tokens": 2, field: value}
        r = HTTP.post(server.url("/v1/chat/completions"), json=body)
        assert assert_openai_error(r, (400,))["param"] == field, (body, r.text)


def test_tokenize_and_detokenize_equal_the_tokenizer(server, client, paths):
    """Issue 49: vLLM's ``/tokenize`` (text and chat) and ``/detokenize`` == the model's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(paths["model"]))
    r = HTTP.post(
        server.url("/tokenize"), json={"model": "tiny", "prompt": PROMPT, "return_token_strs": True}
    )
    assert r.status_code == 200, r.text
    ids = tok.encode(PROMPT)
    assert r.json() == {
        "count": len(ids),
        "max_model_len": 256,
        "tokens": ids,
        "token_strs": tok.convert_ids_to_tokens(ids),
    }
    messages = [{"role": "user", "content": PROMPT}]
    r = HTTP.post(server.url("/tokenize"), json={"messages": messages})
    assert r.json()["tokens"] == chat_tokens(chat(client))[1]  # what chat completions run
    r = HTTP.post(server.url("/detokenize"), json={"model": "a", "tokens": ids})
    assert r.json() == {"prompt": tok.decode(ids)}
    err = assert_openai_error(HTTP.post(server.url("/detokenize"), json={"tokens": [len(tok)]}), (400,))
    assert err["param"] == "tokens"
    err = assert_openai_error(
        HTTP.post(server.url("/tokenize"), json={"model": "nope", "prompt": "x"}), (404,)
    )
    assert err["param"] == "model"
    # issue 49: routes not served answer 404 naming what serves instead
    for route, instead in (
        ("/v1/embeddings", "vllm serve <model> --runner pooling"),
        ("/v1/responses", "POST /v1/chat/completions"),
        ("/v1/audio/speech", '"modalities": ["text", "audio"]'),
    ):
        err = assert_openai_error(HTTP.post(server.url(route), json={"input": "hi"}), (404,))
        assert err["message"].startswith(route) and instead in err["message"], err


def test_hostile_strings_in_every_string_field_are_4xx_naming_the_field(server, paths):
    """Issue 46: every route x string field x {NUL, control characters, 1 MB, non-UTF-8 bytes}: no
    answer >= 500; NUL (anywhere) and control characters (in a name, path or keyword) are 400 naming
    the field, 1 MB is 413 (this server's 1 MB body limit), bytes that are not UTF-8 are 400 naming
    ``body``; the server then still answers as transformers does."""
    from tests.entrypoints.route_strategies import STRING_FIELDS, fuzz_string_fields
    from vllm_omni.entrypoints.openai.protocol import FREE_TEXT_FIELDS

    for route, place, label, status, r in fuzz_string_fields(server, list(STRING_FIELDS)):
        top = place.split(".")[0].split("[")[0]
        param = r.json()["error"]["param"] if status >= 400 else None
        if label == "nul" or (label == "control" and top not in FREE_TEXT_FIELDS):
            assert (status, param) == (400, top), (route, place, label, r.text[:300])
        elif label == "1MB":
            assert status == 413, (route, place)
        elif label == "non-utf8":
            assert (status, param) == (400, "body"), (route, place, r.text[:300])
    assert HTTP.get(server.url("/health")).status_code == 200
    assert completion_tokens(server, lora={"name": "b", "path": str(paths["b"])}) == ref(paths, PROMPT, "b")


def test_logit_bias_and_vllm_sampling_fields_act_as_transformers_says(server, paths):
    """Issue 49: ``logit_bias`` (OpenAI) and vLLM's ``allowed_token_ids`` / ``stop_token_ids`` reach the
    engine (greedy choices == transformers' argmax under the same rule); OpenAI fields that would change
    the answer and are not served are 400s naming them, never ignored."""
    from tests.llm_reference import encode, hf_logits

    def completion(**extra):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        r = HTTP.post(server.url("/v1/completions"), json=body | {"return_token_ids": True} | extra)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    logits = hf_logits(paths["model"], encode(paths["model"], PROMPT))
    allowed = [5, 7, 11, 300]
    first = completion(max_tokens=1, allowed_token_ids=allowed)["token_ids"]
    assert first == [allowed[int(torch.argmax(logits[allowed]))]]
    assert completion(logit_bias={"42": 100})["token_ids"] == [42, 42, 42]
    greedy = ref(paths, PROMPT, None)
    i = next(i for i in range(1, N) if greedy[i] not in greedy[:i])
    stopped = completion(max_tokens=N, stop_token_ids=[greedy[i]])
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"][:i] == greedy[:i], (stopped, greedy)
    for field, value in (
        ("suffix", "end"),
        ("best_of", 2),
        ("prediction", {"type": "content", "content": "x"}),
        ("reasoning_effort", "low"),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"42": 500}),
    ):
        body = {"prompt": PROMPT, "max_tokens": 1, field: value}
        err = assert_openai_error(HTTP.post(server.url("/v1/completions"), json=body), (400,))
        assert err["param"] == field, (field, err)
