"""``GET /metrics``, ``/version`` and ``/ping`` on live servers, driven by the official ``openai`` client.

Two servers: the demo diffusion model with two adapters, one device slot and a host cache of one
(``--worker-backend inline``), where every slot hit / miss and eviction of a known request
sequence is predicted exactly; and the tiny Qwen2 model with two adapters in a stage worker process
(``--worker-backend mp``), whose vLLM ``vllm:`` series carry the ``stage`` label and move with the
tokens generated. Values are read from the Prometheus text with prometheus_client's parser.
"""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.server_utils import (
    HTTP,
    REPO_ROOT,
    assert_openai_error,
    free_port,
    serve_command,
    server_env,
    start_server,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]
DEMO = REPO_ROOT / "examples" / "demo_model"


def scrape(server) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of one ``/metrics`` scrape."""
    reply = HTTP.get(server.url("/metrics"), timeout=60)
    assert reply.status_code == 200, reply.text[:300]
    assert reply.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"no sample {key}; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


@pytest.fixture(scope="module")
def image_server(tmp_path_factory):
    port = free_port()
    adapters = DEMO / "adapters"
    cmd = serve_command(
        str(DEMO), port,
        "--served-model-name", "demo", "--worker-backend", "inline",
        "--max-loras", "1", "--max-cpu-loras", "1",
        "--lora-modules", f"warm={adapters / 'warm'}", f"stripes={adapters / 'stripes'}",
        "--lora-dirs", str(adapters),
    )  # fmt: skip
    log = tmp_path_factory.mktemp("metrics_img") / "server.log"
    srv = start_server(cmd, port, log, server_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1"), timeout=900)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm_server(tiny_llm_assets, tmp_path_factory):
    port = free_port()
    a, b = tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_b
    cmd = serve_command(
        str(tiny_llm_assets.model_dir), port,
        "--served-model-name", "tiny", "--worker-backend", "mp",
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
        "--max-model-len", "256", "--dtype", "float32",
        "--lora-modules", f"a={a}", f"b={b}",
    )  # fmt: skip
    log = tmp_path_factory.mktemp("metrics_llm") / "server.log"
    srv = start_server(cmd, port, log, server_env(), timeout=900)
    yield srv
    srv.stop()


def _image(client: openai.OpenAI, adapter: str | None, seed: int = 0) -> None:
    extra = {"num_inference_steps": 3, "seed": seed}
    if adapter:
        extra["lora"] = {"name": adapter}
    out = client.images.generate(
        model="demo", prompt="a circle", size="32x32", response_format="b64_json", extra_body=extra
    )
    assert out.data[0].b64_json


def test_diffusion_and_adapter_series_follow_the_traffic(image_server):
    client = openai.OpenAI(base_url=image_server.url("/v1"), api_key="unused", max_retries=0, timeout=300)
    before = scrape(image_server)
    # start-up: warm loaded, then stripes loaded into the one-entry host cache (warm evicted)
    assert value(before, "vllm_omni:lora_loaded", stage="0", adapter="stripes") == 1
    assert value(before, "vllm_omni:lora_loaded", stage="0", adapter="warm") == 0
    assert value(before, "vllm_omni:lora_evictions_total", stage="0", adapter="warm") == 1
    assert value(before, "vllm_omni:stage_ready", stage="0", stage_type="diffusion") == 1
    for adapter in ("warm", "warm", "stripes", "warm", None):
        _image(client, adapter)
    after = scrape(image_server)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    warm, stripes = {"stage": "0", "adapter": "warm"}, {"stage": "0", "adapter": "stripes"}
    assert moved("vllm_omni:lora_requests_total", **warm) == 3
    assert moved("vllm_omni:lora_requests_total", **stripes) == 1
    assert moved("vllm_omni:lora_request_latency_seconds_count", **warm) == 3
    # one device slot: warm misses, hits, stripes takes the slot, warm misses again
    assert (
        moved("vllm_omni:lora_slot_hits_total", **warm),
        moved("vllm_omni:lora_slot_misses_total", **warm),
    ) == (1, 2)
    assert (
        moved("vllm_omni:lora_slot_hits_total", **stripes),
        moved("vllm_omni:lora_slot_misses_total", **stripes),
    ) == (0, 1)
    # one host-cache entry: the same sequence in the host cache, each miss a load and an eviction
    assert (
        moved("vllm_omni:lora_cache_hits_total", **warm),
        moved("vllm_omni:lora_cache_misses_total", **warm),
    ) == (1, 2)
    assert (
        moved("vllm_omni:lora_cache_hits_total", **stripes),
        moved("vllm_omni:lora_cache_misses_total", **stripes),
    ) == (0, 1)
    assert moved("vllm_omni:lora_load_seconds_count", **warm) == 2
    assert value(after, "vllm_omni:lora_load_seconds_sum", **warm) > 0
    assert moved("vllm_omni:lora_evictions_total", **warm) == 1
    assert moved("vllm_omni:lora_evictions_total", **stripes) == 2
    assert value(after, "vllm_omni:lora_loaded", **warm) == 1
    # the stage: five requests, five images, three steps each
    assert moved("vllm_omni:stage_requests_total", stage="0", stage_type="diffusion", status="ok") == 5
    assert moved("vllm_omni:diffusion_images_total", stage="0") == 5
    assert moved("vllm_omni:diffusion_queue_time_seconds_count", stage="0") == 5
    assert moved("vllm_omni:diffusion_step_seconds_count", stage="0") == 15
    assert value(after, "vllm_omni:diffusion_step_seconds_sum", stage="0") > 0
    assert value(after, "vllm_omni:diffusion_step_seconds_bucket", stage="0", le="+Inf") == value(
        after, "vllm_omni:diffusion_step_seconds_count", stage="0"
    )


def test_refused_registrations_are_counted(image_server):
    before = scrape(image_server)
    assert not [k for k in before if dict(k[1]).get("stage") == "server"]
    url = image_server.url("/v1/load_lora_adapter")
    clash = HTTP.post(
        url, json={"lora_name": "demo", "lora_path": str(DEMO / "adapters" / "warm")}, timeout=60
    )
    assert_openai_error(clash)
    bad = HTTP.post(url, json={"lora_name": "broken", "lora_path": str(DEMO / "transformer")}, timeout=120)
    assert_openai_error(bad)  # outside --lora-dirs: refused by the server before any stage
    after = scrape(image_server)
    assert value(after, "vllm_omni:lora_registration_failures_total", stage="server", adapter="demo") == 1
    assert value(after, "vllm_omni:lora_registration_failures_total", stage="server", adapter="broken") == 1
    ok = client_models(image_server)
    assert {"warm", "stripes"} <= ok and "broken" not in ok


def client_models(server) -> set[str]:
    return {m["id"] for m in HTTP.get(server.url("/v1/models"), timeout=30).json()["data"]}


def test_version_ping_and_bad_query_parameters(image_server):
    import vllm

    import vllm_omni

    version = HTTP.get(image_server.url("/version"), timeout=30)
    assert version.json() == {"version": vllm.__version__, "vllm_omni_version": vllm_omni.__version__}
    for method in ("GET", "POST"):
        ping = HTTP.request(method, image_server.url("/ping"), timeout=30)
        assert ping.status_code == 200 and ping.json() == {"stages": {"0": "ready"}}
    err = assert_openai_error(HTTP.get(image_server.url("/metrics?names=x"), timeout=30))
    assert err["param"] == "names" and "name[]" in err["message"]
    assert_openai_error(HTTP.get(image_server.url("/version?verbose=1"), timeout=30))
    only = HTTP.get(image_server.url("/metrics?name[]=vllm_omni:diffusion_images"), timeout=30).text
    assert "vllm_omni:diffusion_images_total" in only and "lora_requests" not in only
    assert HTTP.get(image_server.url("/health"), timeout=30).status_code == 200  # still serving


def test_llm_stage_series_in_a_worker_process(llm_server):
    client = openai.OpenAI(base_url=llm_server.url("/v1"), api_key="unused", max_retries=0, timeout=300)
    before = scrape(llm_server)
    for model in ("a", "a", "b", "tiny"):
        out = client.completions.create(
            model=model, prompt="hello world", max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 5
    after = scrape(llm_server)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    engine = {"stage": "0", "engine": "0", "model_name": "tiny"}  # the served name, as with vllm serve
    assert moved("vllm:generation_tokens_total", **engine) == 20
    assert moved("vllm:request_success_total", finished_reason="length", **engine) == 4
    assert moved("vllm:e2e_request_latency_seconds_count", **engine) == 4
    assert value(after, "vllm:num_requests_running", **engine) == 0
    assert moved("vllm_omni:lora_requests_total", stage="0", adapter="a") == 2
    assert moved("vllm_omni:lora_requests_total", stage="0", adapter="b") == 1
    assert moved("vllm_omni:lora_cache_hits_total", stage="0", adapter="a") == 2
    assert moved("vllm_omni:lora_cache_misses_total", stage="0", adapter="b") == 0
    assert value(after, "vllm_omni:lora_loaded", stage="0", adapter="b") == 1
    assert value(after, "vllm_omni:lora_load_seconds_count", stage="0", adapter="a") == 1  # at start-up
    assert moved("vllm_omni:stage_requests_total", stage="0", stage_type="llm_ar", status="ok") == 4
