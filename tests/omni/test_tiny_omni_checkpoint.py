"""The tiny Qwen2.5-Omni checkpoint writer (tools/make_tiny_qwen2_5_omni.py)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tools.make_tiny_llm import hash_dir
from tools.make_tiny_qwen2_5_omni import (
    MROPE_SECTION,
    NAMED_TOKENS,
    SPEAKER,
    TALKER_EOS_TOKEN_IDS,
    make_thinker_adapter,
    make_tiny_qwen2_5_omni,
)


def _hashes(path) -> dict[str, str]:
    return {k: v for k, v in hash_dir(path).items() if k != ".complete"}  # the cache's marker


def test_writer_is_deterministic(tmp_path, tiny_omni_assets):
    again = make_tiny_qwen2_5_omni(tmp_path / "again")
    assert _hashes(again) == _hashes(tiny_omni_assets.model_dir)


def test_checkpoint_carries_the_traps(tiny_omni_assets):
    cfg = json.loads((tiny_omni_assets.model_dir / "config.json").read_text())
    thinker = cfg["thinker_config"]
    text = thinker["text_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert head_dim >= 32 and text["num_attention_heads"] >= 4
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2 == sum(MROPE_SECTION)
    assert {"vision_start_token_id", "vision_end_token_id"} <= set(thinker)
    assert all(len(d) == 3 for d in cfg["token2wav_config"]["bigvgan_config"]["resblock_dilation_sizes"])
    assert max(TALKER_EOS_TOKEN_IDS) < cfg["talker_config"]["vocab_size"]
    tok_cfg = json.loads((tiny_omni_assets.model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["extra_special_tokens"] == NAMED_TOKENS
    assert (tiny_omni_assets.model_dir / "spk_dict.pt").is_file()


def test_transformers_generates_text_and_audio(tiny_omni_assets):
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    model_dir = tiny_omni_assets.model_dir
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.audio_token == NAMED_TOKENS["audio_token"]
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Once upon a time"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    torch.manual_seed(0)
    seq, wav = model.generate(
        ids,
        speaker=SPEAKER,
        thinker_max_new_tokens=6,
        thinker_do_sample=False,
        talker_max_new_tokens=12,
        talker_do_sample=False,
        talker_eos_token_id=list(TALKER_EOS_TOKEN_IDS),
        token2wav_num_steps=2,
    )
    assert seq.shape[1] > ids.shape[1]
    assert wav.dtype == torch.float32 and wav.ndim == 1 and wav.numel() > 0 and torch.isfinite(wav).all()


def _keys(adapter_dir):
    return load_file(adapter_dir / "adapter_model.safetensors")


def test_thinker_adapters_share_weights_under_two_layouts(tiny_omni_assets):
    full = _keys(tiny_omni_assets.thinker_adapter)
    alone = _keys(tiny_omni_assets.thinker_alone_adapter)
    assert full and all(k.startswith("base_model.model.thinker.model.layers.") for k in full)
    assert all(k.startswith("base_model.model.model.layers.") for k in alone)
    renamed = {k.replace("base_model.model.thinker.", "base_model.model.", 1): v for k, v in full.items()}
    assert renamed.keys() == alone.keys()
    assert all(torch.equal(renamed[k], alone[k]) for k in renamed)
    # Only the decoder: the audio/vision encoders' q_proj/v_proj are not targeted.
    assert not any("audio_tower" in k or "visual" in k for k in full)


def test_thinker_adapter_is_deterministic(tmp_path, tiny_omni_assets):
    again = make_thinker_adapter(tiny_omni_assets.model_dir, tmp_path / "a")
    assert _hashes(again) == _hashes(tiny_omni_assets.thinker_adapter)
