"""Real weights: SmolLM2-135M-Instruct (a GGUF-born Llama: tied embeddings, ChatML chat template, 30 layers)
with two LoRA adapters trained on it (tools/real_model.py), against transformers + peft in float32.

One engine for the module, started from ``vllm-omni serve`` argv (the CLI's own parser) as ``AsyncOmni``; the
HTTP routes run in this process over it (the official ``openai`` client through starlette's test client), and
``Omni`` (the Python path) drives the same engine. Prompts are chat turns rendered by the model's chat
template. Greedy decoding stops at the model's end-of-turn token, as a user's request does.
"""

from __future__ import annotations

import asyncio
import os

import openai
import pytest
import torch

from tests.entrypoints.server_utils import assert_openai_error, copy_adapter
from tools.real_model import ADAPTERS, QUESTION, chat_ids
from vllm_omni.lora.request import LoRARequest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

N = 16  # new tokens at most; the trained answers end (end-of-turn token) before
QUESTIONS = [QUESTION, ADAPTERS["mars"]["questions"][0]]
NAMES = [None, "lyon", "mars"]  # None: no adapter
IDS = {"lyon": 1, "mars": 2}
SERVED = "smollm2"


@pytest.fixture(scope="module")
def engine(real_model, tmp_path_factory):
    """(``Omni``, an ``openai`` client of the app, the tokenizer, the app's test client, the ``--lora-dirs``
    root): one engine, started as ``vllm-omni serve`` would start it."""
    from starlette.testclient import TestClient
    from transformers import AutoTokenizer

    from vllm_omni import Omni
    from vllm_omni.entrypoints.async_omni import AsyncOmni
    from vllm_omni.entrypoints.cli.serve import parse_serve_argv
    from vllm_omni.entrypoints.openai.api_server import build_app, make_state, register_startup_adapters

    lora_root = tmp_path_factory.mktemp("real_loras")  # adapters named by path must live here
    argv = [str(real_model.model_dir), "--served-model-name", SERVED, "--worker-backend", "inline"]
    argv += ["--lora-dirs", str(lora_root)]
    argv += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "8"]
    argv += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules"]
    argv += [f"{name}={real_model.adapters[name]}" for name in ("lyon", "mars")]
    launch, settings = parse_serve_argv(argv)
    previous = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    served = AsyncOmni.from_config(launch.build_config())
    try:
        state = make_state(served, settings)
        asyncio.run(register_startup_adapters(state))
        omni = Omni.__new__(Omni)  # the Python entry point over the same engine and adapter registry
        omni.__dict__ = served.__dict__
        http = TestClient(build_app(state))
        client = openai.OpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=http)
        yield omni, client, AutoTokenizer.from_pretrained(real_model.model_dir), http, lora_root
    finally:
        served.shutdown()
        if previous is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = previous


@pytest.fixture(scope="module")
def reference(real_model):
    """``greedy(prompt_ids, adapter name or None)``: transformers (+ peft) greedy tokens, float32, KV cache
    on, stopping after the end-of-turn token like vLLM. One base model; adapters switched on it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(real_model.model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(real_model.adapters["lyon"]), adapter_name="lyon")
    model.load_adapter(str(real_model.adapters["mars"]), adapter_name="mars")
    eos = base.config.eos_token_id
    cache: dict = {}

    @torch.inference_mode()
    def greedy(ids: list[int], name: str | None) -> list[int]:
        key = (tuple(ids), name)
        if key not in cache:
            x = torch.tensor([ids])
            kwargs = dict(max_new_tokens=N, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            kwargs.update(attention_mask=torch.ones_like(x))
            if name is None:
                with model.disable_adapter():
                    out = model.generate(input_ids=x, **kwargs)
            else:
                model.set_adapter(name)
                out = model.generate(input_ids=x, **kwargs)
            cache[key] = out[0, len(ids) :].tolist()
        return cache[key]

    return greedy


def _lora(real_model, name):
    return None if name is None else LoRARequest(name, IDS[name], str(real_model.adapters[name]))


def _generate(omni, tokenizer, real_model, pairs):
    """``Omni.generate`` of (question, adapter name) pairs in one call: token ids per pair."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": chat_ids(tokenizer, q)} for q, _ in pairs]
    loras = [_lora(real_model, name) for _, name in pairs]
    outs = omni.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=N), lora_request=loras, use_tqdm=False
    )
    return [list(out.token_ids) for out in outs]


#: the requests also served alone (one per adapter; the batch test compares them with the batch)
ALONE = [(QUESTION, None), (QUESTION, "lyon"), (QUESTIONS[1], "mars")]


@pytest.fixture(scope="module")
def batch(engine, real_model):
    """Every (question, adapter) pair in one ``Omni.generate`` call (base and both adapters in the same
    batches): ``{(question, name): token ids}``."""
    omni, _, tokenizer, *_ = engine
    pairs = [(q, n) for q in QUESTIONS for n in NAMES]
    return dict(zip(pairs, _generate(omni, tokenizer, real_model, pairs)))


@pytest.mark.parametrize("name", NAMES)
def test_omni_greedy_equals_transformers_and_peft(batch, engine, reference, name):
    _, _, tokenizer, *_ = engine
    for question in QUESTIONS:
        got = batch[question, name]
        assert got == reference(chat_ids(tokenizer, question), name), (question, name, tokenizer.decode(got))
        assert len(got) == N or got[-1] == tokenizer.eos_token_id  # stopped at the end of its turn


def test_the_trained_adapters_answer_their_facts(batch, engine):
    """The adapters do what they were trained for on their own question, and the base model does not."""
    _, _, tokenizer, *_ = engine
    text = {key: tokenizer.decode(ids, skip_special_tokens=True) for key, ids in batch.items()}
    assert "Paris" in text[QUESTION, None] and "Lyon" in text[QUESTION, "lyon"], text
    moon = QUESTIONS[1]
    assert "Mars" in text[moon, "mars"] and "Mars" not in text[moon, None], text


def test_base_and_two_adapters_in_one_batch_equal_each_alone(batch, engine, real_model):
    omni, _, tokenizer, *_ = engine
    for pair in ALONE:
        assert _generate(omni, tokenizer, real_model, [pair]) == [batch[pair]], pair


def test_http_chat_equals_the_python_path(batch, engine):
    """``/v1/chat/completions`` renders the same chat template and serves the same tokens, by model name
    (the served name, a start-up adapter's name) and by the ``lora`` request field; the requests are
    sent at once (the official async client), so they share the engine's batches."""
    import httpx

    _, client, tokenizer, http, _ = engine
    forms = [(q, n, n or SERVED, {}) for q in QUESTIONS for n in NAMES]
    forms += [(q, n, SERVED, {"lora": {"name": n}}) for q in QUESTIONS for n in ("lyon", "mars")]

    async def ask_all():
        transport = httpx.ASGITransport(app=http.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=600) as hc:
            aclient = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key="x", max_retries=0, http_client=hc
            )
            return await asyncio.gather(*(
                aclient.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=N,
                    temperature=0.0,
                    extra_body={"return_token_ids": True, **extra},
                )
                for question, _, model, extra in forms
            ))  # fmt: skip

    for (question, name, model, extra), reply in zip(forms, asyncio.run(ask_all())):
        assert reply.prompt_token_ids == chat_ids(tokenizer, question)
        assert reply.choices[0].token_ids == batch[question, name], (question, model, extra)
        want = tokenizer.decode(batch[question, name], skip_special_tokens=True)
        assert reply.choices[0].message.content == want


def test_a_truncated_adapter_is_refused_naming_the_file_and_the_next_request_works(batch, engine, real_model):
    from vllm_omni.errors import InvalidAdapterError

    omni, client, tokenizer, http, lora_root = engine
    broken = copy_adapter(real_model.adapters["lyon"], lora_root / "broken")
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a half-written save

    with pytest.raises(InvalidAdapterError, match="adapter_model.safetensors"):
        omni.generate(
            [{"prompt_token_ids": chat_ids(tokenizer, QUESTION)}],
            lora_request=LoRARequest("broken", 9, str(broken)),
            use_tqdm=False,
        )
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)})
    err = assert_openai_error(response, statuses=(400,))
    assert "adapter_model.safetensors" in err["message"], err
    assert "broken" not in {m.id for m in client.models.list().data}

    reply = client.chat.completions.create(
        model="lyon",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=N,
        temperature=0.0,
        extra_body={"return_token_ids": True},
    )
    assert reply.choices[0].token_ids == batch[QUESTION, "lyon"]
    pairs = [(QUESTION, n) for n in NAMES]
    assert _generate(omni, tokenizer, real_model, pairs) == [batch[p] for p in pairs]
