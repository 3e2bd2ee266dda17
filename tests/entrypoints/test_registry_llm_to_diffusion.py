"""The adapter registry behind the HTTP layer on a multi-stage pipeline (issue 21, rules 2 and 5).

``vllm-omni serve <llm> --pipeline llm_to_diffusion --lora-modules a=<LLM adapter>`` used to stop at
start-up with the diffusion stage's error (the adapter was offered to every stage), and
``POST /v1/load_lora_adapter`` of the same adapter answered 400 while stage 0 kept it. An adapter now
registers on the stages it targets (the entry stage by default), all-or-nothing.

The app runs in this process (the ``serve`` argv parsed by the CLI's own parser, the routes through
httpx's ASGI transport) so that an adapter added from Python (``AsyncOmni.add_lora``) can be checked in
``/v1/models`` of the same engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from types import SimpleNamespace

import httpx
import pytest

from tests.entrypoints.server_utils import copy_adapter
from vllm_omni.entrypoints.cli.serve import parse_serve_argv
from vllm_omni.entrypoints.openai.api_server import build_app, make_state, register_startup_adapters
from vllm_omni.lora.request import LoRARequest

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def served(tiny_llm_assets, tiny_z_image_dir, tmp_path_factory):
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    root = tmp_path_factory.mktemp("registry_loras")
    copy_adapter(tiny_llm_assets.adapter_b, root / "b")
    copy_adapter(tiny_llm_assets.adapter_rank64, root / "big")
    overrides = {
        "0": {"enable_lora": True, "max_lora_rank": 16, "max_model_len": 256, "dtype": "float32"},
        "1": {"model": str(tiny_z_image_dir), "dtype": "float32", "enable_progress_bar": False},
    }
    argv = [str(tiny_llm_assets.model_dir), "--pipeline", "llm_to_diffusion", "--worker-backend", "inline"]
    argv += ["--stage-overrides", json.dumps(overrides), "--served-model-name", "tiny"]
    argv += ["--lora-modules", f"a={tiny_llm_assets.adapter_a}", "--lora-dirs", str(root)]
    launch, settings = parse_serve_argv(argv)
    previous = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    omni = AsyncOmni.from_config(launch.build_config())
    try:
        state = make_state(omni, settings)
        asyncio.run(register_startup_adapters(state))  # used to raise the diffusion stage's ConfigError
        yield omni, build_app(state), root
    finally:
        omni.shutdown()
        if previous is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = previous


def _http(app, calls):
    """Run ``calls(client)`` (a coroutine function) against ``app``; its result."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=600) as client:
            return await calls(client)

    return asyncio.run(main())


def _model_ids(app) -> list[str]:
    async def get(client):
        return [m["id"] for m in (await client.get("/v1/models")).json()["data"]]

    return _http(app, get)


def test_a_startup_adapter_registers_on_the_entry_stage_only(served):
    omni, app, _ = served
    record = omni.adapter_registry.get("a")
    assert record.targets == (0,) and record.stages[0].state == "loaded"
    assert asyncio.run(omni.list_loras(stage_id=0)) == {record.int_id}
    assert asyncio.run(omni.list_loras(stage_id=1)) == set()
    assert _model_ids(app) == ["tiny", "a"]


def test_http_load_targets_the_entry_stage_and_a_refusal_leaves_nothing(served):
    omni, app, root = served

    async def calls(client):
        ok = await client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(root / "b")})
        before = await omni.list_loras(stage_id=0)
        bad = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(root / "big")}
        )
        return ok, before, bad

    ok, before, bad = _http(app, calls)
    assert ok.status_code == 200, ok.text
    assert (
        omni.adapter_registry.get("b").targets == (0,) and asyncio.run(omni.list_loras(stage_id=1)) == set()
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    message = bad.json()["error"]["message"]
    assert "'big'" in message and "Stage 0" in message and "rank" in message, message
    assert asyncio.run(omni.list_loras(stage_id=0)) == before  # nothing of 'big' stayed anywhere
    assert omni.adapter_registry.get("big") is None and "big" not in _model_ids(app)


def test_concurrent_loads_and_unloads_of_one_name_have_one_outcome(served, tiny_llm_assets):
    omni, app, root = served
    path = str(copy_adapter(tiny_llm_assets.adapter_a, root / "c"))
    body = {"lora_name": "c", "lora_path": path}

    async def loads(client):
        return await asyncio.gather(*(client.post("/v1/load_lora_adapter", json=body) for _ in range(6)))

    statuses = sorted(r.status_code for r in _http(app, loads))
    assert statuses == [200] + [400] * 5, statuses

    async def churn(client):
        calls = []
        for i in range(8):
            if i % 2:
                calls.append(client.post("/v1/unload_lora_adapter", json={"lora_name": "c"}))
            else:
                calls.append(client.post("/v1/load_lora_adapter", json=body | {"load_inplace": True}))
        return await asyncio.gather(*calls)

    assert {r.status_code for r in _http(app, churn)} <= {200, 404}
    record = omni.adapter_registry.get("c")
    held = asyncio.run(omni.list_loras(stage_id=0))
    assert (record is not None) == ("c" in _model_ids(app)) == (record is not None and record.int_id in held)
    shutil.rmtree(path)


def test_a_python_added_adapter_is_listed_and_named_in_replies(served, tiny_llm_assets):
    omni, app, _ = served
    assert asyncio.run(omni.add_lora(LoRARequest("py", 909, str(tiny_llm_assets.adapter_a))))
    assert "py" in _model_ids(app)

    async def chat(client):
        body = {
            "model": "py",
            "messages": [{"role": "user", "content": "a cat"}],
            "max_tokens": 3,
            "size": "32x32",
            "num_inference_steps": 2,
            "seed": 1,
        }
        return await client.post("/v1/chat/completions", json=body)

    reply = _http(app, chat)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == "py"  # the adapter that served, not the base model
    assert body["choices"][0]["message"]["content"][0]["type"] == "image_url"


def test_a_seeded_image_request_is_reproducible_whichever_way_it_names_its_adapter(served, tiny_llm_assets):
    """Issue 35 item 8: the request's ``seed`` reaches every stage. Two ``/v1/images/generations``
    with ``seed: 0`` on ``llm_to_diffusion`` gave different images (stage 0 sampled its text unseeded);
    now the PNGs are byte-identical, also with the adapter chosen by ``model``, ``lora.name`` or
    ``lora.path`` (official ``openai`` client). The image equals ``AsyncOmni.generate`` with the
    per-stage list the rule spells out (stage 0: the route's LLM params with the seed); from Python
    one seeded ``OmniDiffusionSamplingParams`` seeds stage 0 the same way."""
    import base64
    import io

    import numpy as np
    import openai
    from PIL import Image
    from starlette.testclient import TestClient
    from vllm import SamplingParams

    from vllm_omni.entrypoints.openai.routes.common import default_llm_params
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    omni, app, root = served
    path = str(copy_adapter(tiny_llm_assets.adapter_a, root / "seeded"))
    assert asyncio.run(omni.add_lora(LoRARequest("seeded", 910, path)))
    client = openai.OpenAI(base_url="http://test/v1", api_key="x", http_client=TestClient(app))
    gen = {"num_inference_steps": 2, "height": 32, "width": 32}

    def image(seed=0, model="tiny", lora=None):
        extra = gen | {"seed": seed} | ({"lora": lora} if lora else {})
        reply = client.images.generate(
            model=model, prompt="a cat", response_format="b64_json", extra_body=extra
        )
        return reply.data[0].b64_json

    first = image(model="seeded")
    assert image(model="seeded") == first
    assert image(lora={"name": "seeded"}) == first == image(lora={"path": path})
    assert image(seed=1, model="seeded") != first  # the seed is what made them equal

    llm = default_llm_params(SimpleNamespace(info=omni.entry_stage_info))
    llm.seed = 0
    dparams = OmniDiffusionSamplingParams(**gen, seed=0)
    adapter = LoRARequest("seeded", 910, path)

    async def run(params):
        return [o async for o in omni.generate("a cat", params, lora_request=adapter)][-1]

    explicit = asyncio.run(run([llm, dparams]))
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(first))).convert("RGB"))
    np.testing.assert_array_equal(np.asarray(explicit.images[0].convert("RGB")), pixels)
    one, again = asyncio.run(run(dparams)), asyncio.run(run(dparams))
    ruled = asyncio.run(run([SamplingParams(seed=0), dparams]))  # stage 0's default params, seed 0
    assert one.prompt == again.prompt == ruled.prompt
    np.testing.assert_array_equal(np.asarray(one.images[0]), np.asarray(ruled.images[0]))
    assert dparams.seed == 0 and llm.max_tokens == 64  # nothing passed in was changed


def _metrics(app) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    async def get(client):
        return (await client.get("/metrics")).text

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(_http(app, get))
        for s in family.samples
    }


def test_metrics_name_adapters_as_clients_do_across_in_place_updates(served, tiny_llm_assets):
    """Issue 35 items 6 and 7 over HTTP. After ``load_inplace`` of rewritten files, ``/metrics`` still
    shows the adapter loaded (the old version's unload used to zero the name's ``lora_loaded``), and no
    series, ours or vLLM's ``vllm:lora_requests_info``, names a version (``m@<id>``). With the stage's one
    cache entry pinned, the next ``load_inplace`` is swapped into the old version's pinned place (it was
    a 400 before 014cfbe): the new version serves, and ``/metrics`` still names ``m`` loaded and pinned,
    never a version."""
    omni, app, root = served
    path = copy_adapter(tiny_llm_assets.adapter_a, root / "m")
    body = {"lora_name": "m", "lora_path": str(path)}
    image = {"model": "m", "prompt": "a cat", "size": "32x32", "num_inference_steps": 2, "seed": 3}

    def post(route, json):
        async def call(client):
            return await client.post(route, json=json)

        return _http(app, call)

    assert post("/v1/load_lora_adapter", body).status_code == 200
    assert post("/v1/images/generations", image).status_code == 200
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(tiny_llm_assets.adapter_b / name, path / name)
    assert post("/v1/load_lora_adapter", body | {"load_inplace": True}).status_code == 200
    record = omni.adapter_registry.get("m")
    assert record.version == 2 and record.engine.lora_int_id != record.int_id
    assert post("/v1/images/generations", image).status_code == 200
    samples = _metrics(app)
    assert samples[("vllm_omni:lora_loaded", (("adapter", "m"), ("stage", "0")))] == 1
    labelled = {dict(k[1])["adapter"] for k in samples if "adapter" in dict(k[1])}
    assert "m" in labelled and not [n for n in labelled if re.search(r"@\d+$", n)], labelled
    listed = {
        n
        for (sample, labels), _ in samples.items()
        if sample == "vllm:lora_requests_info"
        for key, value in labels
        if key.endswith("_lora_adapters")
        for n in value.split(",")
    }
    assert "m" in listed and not [n for n in listed if re.search(r"@\d+$", n)], listed

    assert asyncio.run(omni.pin_lora(record.int_id))  # the stage's one cache entry (max_cpu_loras 1)
    v2_engine_id = record.engine.lora_int_id
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(tiny_llm_assets.adapter_a / name, path / name)
    # no free slot: the new version takes the old one's pinned place
    assert post("/v1/load_lora_adapter", body | {"load_inplace": True}).status_code == 200
    swapped = omni.adapter_registry.get("m")
    assert swapped.version == 3 and swapped.engine.lora_int_id != v2_engine_id
    assert post("/v1/images/generations", image).status_code == 200
    samples = _metrics(app)
    assert samples[("vllm_omni:lora_pinned", (("adapter", "m"), ("stage", "0")))] == 1
    assert samples[("vllm_omni:lora_loaded", (("adapter", "m"), ("stage", "0")))] == 1
    labelled = {dict(k[1])["adapter"] for k in samples if "adapter" in dict(k[1])}
    assert "m" in labelled and not [n for n in labelled if re.search(r"@\d+$", n)], labelled
    assert post("/v1/unload_lora_adapter", {"lora_name": "m"}).status_code == 200
