"""Per-stage request adapters (opt-in extension): ``lora_request={stage_id: adapter}`` gives each
LLM stage of a pipeline its own adapter. ``llm_chain``: two tiny Qwen2 stages, both with LoRA;
each stage's tokens equal transformers+peft with that stage's adapter."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from tests.llm_reference import hf_greedy
from vllm_omni.errors import InvalidAdapterError, InvalidRequestError
from vllm_omni.lora.request import LoRARequest, RequestAdapter

pytestmark = pytest.mark.engine

N = 8
PROMPT = "hello world"
LORA = {"enable_lora": True, "max_lora_rank": 16, "max_model_len": 256, "dtype": "float32"}


@pytest.fixture(scope="module")
def chain(tiny_llm_assets):
    from vllm_omni import Omni

    with Omni(
        str(tiny_llm_assets.model_dir), pipeline="llm_chain", stage_overrides={"0": LORA, "1": LORA}
    ) as omni:
        yield omni


def _params():
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


def _check_chain(out, model, stage0_adapter, stage1_adapter):
    stage0 = out.stage_outputs[0].outputs[0]
    assert list(stage0.token_ids) == hf_greedy(model, PROMPT, N, stage0_adapter)
    assert out.prompt == stage0.text
    assert out.token_ids == hf_greedy(model, stage0.text, N, stage1_adapter)


def test_each_stage_gets_its_own_adapter(chain, tiny_llm_assets):
    a = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    b = LoRARequest("b", 2, str(tiny_llm_assets.adapter_b))
    model = tiny_llm_assets.model_dir
    (out,) = chain.generate(PROMPT, _params(), lora_request={0: a, 1: b}, use_tqdm=False)
    _check_chain(out, model, tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_b)
    # only the later stage; and a single LoRARequest keeps its meaning: the entry stage only
    (only1,) = chain.generate(PROMPT, _params(), lora_request={1: b}, use_tqdm=False)
    _check_chain(only1, model, None, tiny_llm_assets.adapter_b)
    (entry,) = chain.generate(PROMPT, _params(), lora_request=a, use_tqdm=False)
    _check_chain(entry, model, tiny_llm_assets.adapter_a, None)
    # per prompt: a dict, a plain adapter, nothing; and the same adapter on both stages
    outs = chain.generate([PROMPT] * 3, _params(), lora_request=[{0: b, 1: a}, a, None], use_tqdm=False)
    _check_chain(outs[0], model, tiny_llm_assets.adapter_b, tiny_llm_assets.adapter_a)
    _check_chain(outs[1], model, tiny_llm_assets.adapter_a, None)
    _check_chain(outs[2], model, None, None)
    (both,) = chain.generate(PROMPT, _params(), lora_request={0: a, 1: a}, use_tqdm=False)
    _check_chain(both, model, tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_a)
    # the RequestAdapter form (the HTTP layer's) with a stage id
    (ra,) = chain.generate(
        PROMPT, _params(), adapters=[RequestAdapter(a), RequestAdapter(b, stage_id=1)], use_tqdm=False
    )
    _check_chain(ra, model, tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_b)


@pytest.mark.parametrize(
    ("lora_request", "error", "match"),
    [
        (
            "unknown_stage",
            InvalidRequestError,
            r"lora_request names stage 5, but pipeline 'llm_chain' has stages 0\.\.1",
        ),
        ("str_key", InvalidRequestError, r"lora_request keys must be stage ids"),
        ("not_an_adapter", InvalidRequestError, r"lora_request\[1\] must be a LoRARequest"),
        ("bad_adapter", InvalidAdapterError, r"Stage 1 \(llm_ar\)"),
    ],
)
def test_bad_stage_adapters_are_refused_before_anything_runs(
    chain, tiny_llm_assets, tmp_path, lora_request, error, match
):
    a = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    value = {
        "unknown_stage": {0: a, 5: a},
        "str_key": {"1": a},
        "not_an_adapter": {1: "adapter_b"},
        "bad_adapter": {1: LoRARequest("missing", 9, str(tmp_path / "missing"))},
    }[lora_request]
    before = chain.list_loras()
    with pytest.raises(error, match=match):
        chain.generate(PROMPT, _params(), lora_request=value, use_tqdm=False)
    assert chain.list_loras() == before  # the entry stage's adapter was not loaded either


def test_async_omni_takes_per_stage_adapters_too(chain, tiny_llm_assets):
    """AsyncOmni over the running pipeline (its state shared, so no second pair of engines starts)."""
    import asyncio

    from vllm_omni.entrypoints.async_omni import AsyncOmni

    aomni = object.__new__(AsyncOmni)
    aomni.__dict__.update(chain.__dict__)
    a = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    b = LoRARequest("b", 2, str(tiny_llm_assets.adapter_b))

    async def run(lora_request):
        return [o async for o in aomni.generate(PROMPT, _params(), lora_request=lora_request)]

    (out,) = asyncio.run(run({0: a, 1: b}))
    _check_chain(out, tiny_llm_assets.model_dir, tiny_llm_assets.adapter_a, tiny_llm_assets.adapter_b)
    with pytest.raises(InvalidRequestError, match="lora_request names stage 2"):
        asyncio.run(run({2: b}))


@pytest.fixture(scope="module")
def http(chain, tiny_llm_assets):
    """The HTTP app over the running pipeline (in process), and the openai client on it."""
    import openai
    from starlette.testclient import TestClient

    from vllm_omni.entrypoints.async_omni import AsyncOmni
    from vllm_omni.entrypoints.openai.api_server import build_app
    from vllm_omni.entrypoints.openai.settings import ServerSettings
    from vllm_omni.entrypoints.openai.state import make_state

    aomni = object.__new__(AsyncOmni)
    aomni.__dict__.update(chain.__dict__)
    state = make_state(aomni, ServerSettings(lora_dirs=[str(tiny_llm_assets.adapter_a.parent)]))
    with TestClient(build_app(state)) as client:
        yield state, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)


def test_http_lora_entries_take_a_stage(http, chain, tiny_llm_assets):
    from vllm_omni.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm_omni.entrypoints.openai.routes.chat import prepare_text_chat

    state, client = http
    a = {"path": str(tiny_llm_assets.adapter_a)}
    b = {"path": str(tiny_llm_assets.adapter_b), "stage": 1}
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": state.base_name, "messages": messages, "max_tokens": N, "temperature": 0.0}

    def http_text(lora):
        resp = client.chat.completions.create(**body, extra_body={"lora": lora, "ignore_eos": True})
        return resp.choices[0].message.content

    def python_text(lora_request):
        run = prepare_text_chat(state, ChatCompletionRequest(**body, ignore_eos=True), ())
        (out,) = chain.generate(run.prompt, run.params, lora_request=lora_request, use_tqdm=False)
        return out.text

    la = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    lb = LoRARequest("b", 2, str(tiny_llm_assets.adapter_b))
    both = http_text([a, b])
    assert both == python_text({0: la, 1: lb})
    assert http_text([b]) == python_text({1: lb})
    assert both != http_text([a])  # stage 1's adapter did reach stage 1

    import openai

    def refused(lora, match):
        with pytest.raises(openai.BadRequestError) as err:
            http_text(lora)
        assert err.value.status_code == 400
        assert match in err.value.body["message"], err.value.body

    refused([{**b, "stage": 7}], "lora_request names stage 7")
    refused([{**b, "stage": "1"}], "lora[0].stage must be a stage id")
    refused([b, {**b, "int_id": 99}], "Stage 1 (llm_ar): an LLM stage applies one adapter per request")


@pytest.mark.parametrize(
    ("scale", "match"),
    [
        # True == 1.0, but a bool is not a scale (as on the entry stage)
        (True, r"adapters\[0\].*finite number"),
        ("1.0", r"adapters\[0\].*finite number"),
        (0.5, r"Stage 1 \(llm_ar\): an LLM stage applies one adapter per request, at scale 1\.0"),
    ],
)
def test_a_later_stage_adapter_gets_the_entry_stages_scale_checks(chain, tiny_llm_assets, scale, match):
    a = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    before = chain.list_loras()
    with pytest.raises(InvalidRequestError, match=match):
        chain.generate(PROMPT, _params(), adapters=[RequestAdapter(a), RequestAdapter(a, scale, stage_id=1)])
    assert chain.list_loras() == before
