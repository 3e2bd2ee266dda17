"""Deterministic writer of a tiny random Qwen3-Omni checkpoint (MoE thinker, talker, code2wav).

The directory loads with transformers' ``Qwen3OmniMoeForConditionalGeneration.from_pretrained``
and with vLLM (``Qwen3OmniMoeForConditionalGeneration`` maps to vLLM's
``Qwen3OmniMoeThinkerForConditionalGeneration``, which drops the talker and code2wav weights).
Sizes are the smallest both accept:

- the thinker's decoder has 4 heads of 32 (vLLM's CPU attention needs a head size of at least
  32), interleaved M-RoPE whose ``mrope_section`` sums to ``head_dim / 2``, and 4 experts (2 per
  token) in layer 0; layer 1 is dense (``mlp_only_layers``), so vLLM's MoE and dense MLP paths
  both run under LoRA;
- the vision config carries ``image_size`` and ``apply_vit_abs_pos_embed`` (vLLM reads them;
  ``image_size / patch_size`` squared is ``num_position_embeddings``), the thinker config
  ``audio_end_token_id``;
- the talker's codec vocabulary is :data:`CODEBOOK_SIZE` sound codes followed by 1024 ids for its
  special tokens (transformers' ``generate`` suppresses the top 1024 ids but ``codec_eos``); its
  text config needs ``shared_expert_intermediate_size`` and its config ``spatial_merge_size``;
- the tokenizer encodes the chat roles (``system``, ``user``, ``assistant``) as single tokens,
  because the talker finds a turn's role by the token after ``<|im_start|>``.

Weights are seeded Gaussian noise (std :data:`WEIGHT_STD`); norms are 1; the code2wav's output
convolution (weight and bias) is then scaled by :data:`CODE2WAV_OUTPUT_SCALE`, so that its waveform
stays inside transformers' clamp to [-1, 1] (unscaled, nearly every sample came out at +-1). The
tokenizer is :func:`tools.make_tiny_llm.write_tokenizer`'s byte-level BPE plus the tokens above.
Running the writer twice gives byte-identical files.

CLI::

    python -m tools.make_tiny_qwen3_omni DIR
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from tools.make_tiny_llm import BPE_VOCAB_SIZE, _atomic_build, _fill_random_, _write_json, write_tokenizer
from tools.make_tiny_qwen2_5_omni import preprocessor_config, save_adapter, write_random_model

#: Bump when the output changes, so that stale cached assets get rebuilt.
QWEN3_OMNI_ASSETS_VERSION = "2"
MODEL_SEED = 5309
WEIGHT_STD = 0.15
#: Factor on the code2wav's last convolution (the one that writes the waveform, before the clamp
#: to [-1, 1]). Unscaled, the random decoder's output has std ~300 (max ~1400), so over 98% of the
#: samples were clamped to +-1 and a waveform comparison compared signs; scaled, the tiny requests'
#: waveforms have std ~0.1 and no sample at |x| >= 0.999 (see :func:`_scale_code2wav_output`).
CODE2WAV_OUTPUT_SCALE = 3e-4

#: Special tokens after the BPE vocabulary, in id order (ids BPE_VOCAB_SIZE ...).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
    "system",
    "user",
    "assistant",
)
#: Named multimodal tokens of the tokenizer (``tokenizer.image_token`` ...), read by the processor.
NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

HIDDEN = 128
HEADS = 4
HEAD_DIM = 32
MROPE_SECTION = [6, 5, 5]  # sums to HEAD_DIM / 2
NUM_EXPERTS = 4

# The talker: codes 0..CODEBOOK_SIZE-1, then 1024 special ids (the real layout: 2048 + 1024).
CODEBOOK_SIZE = 64
TALKER_VOCAB = CODEBOOK_SIZE + 1024
NUM_CODE_GROUPS = 4
CODEC_PAD, CODEC_BOS, CODEC_EOS = CODEBOOK_SIZE, CODEBOOK_SIZE + 1, CODEBOOK_SIZE + 2
CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = CODEBOOK_SIZE + 3, CODEBOOK_SIZE + 4, CODEBOOK_SIZE + 5
#: Speakers of the talker config (``speaker_id``: name -> codec id); transformers' default is "Ethan".
SPEAKER_IDS = {"ethan": CODEBOOK_SIZE + 10, "chelsie": CODEBOOK_SIZE + 11}
TALKER_HIDDEN = 64


def _rope() -> dict:
    return {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": list(MROPE_SECTION),
        "interleaved": True,
        "mrope_interleaved": True,
    }


def _thinker_config(ids: dict[str, int]) -> dict:
    text = {
        "vocab_size": BPE_VOCAB_SIZE + len(SPECIAL_TOKENS),
        "hidden_size": HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _rope(),
        "moe_intermediate_size": 64,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "tie_word_embeddings": False,  # vLLM reads it from the text config
        "initializer_range": WEIGHT_STD,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": HIDDEN,
        "num_position_embeddings": 64,
        "image_size": 128,  # (128 / 16) ** 2 == num_position_embeddings
        "apply_vit_abs_pos_embed": True,
        "deepstack_visual_indexes": [0],
        "initializer_range": WEIGHT_STD,
    }
    audio = {
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 128,
        "d_model": 64,
        "output_dim": HIDDEN,
        "downsample_hidden_size": 32,
        "initializer_range": WEIGHT_STD,
    }
    return {
        "text_config": text,
        "vision_config": vision,
        "audio_config": audio,
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "audio_end_token_id": ids["<|audio_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "user_token_id": ids["user"],
        "initializer_range": WEIGHT_STD,
    }


def _talker_config(ids: dict[str, int]) -> dict:
    text = {
        "vocab_size": TALKER_VOCAB,
        "hidden_size": TALKER_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 1024,
        "rope_parameters": _rope(),
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "initializer_range": WEIGHT_STD,
    }
    predictor = {
        "vocab_size": CODEBOOK_SIZE,
        "hidden_size": TALKER_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 64,
        "num_code_groups": NUM_CODE_GROUPS,
        "initializer_range": WEIGHT_STD,
    }
    return {
        "text_config": text,
        "code_predictor_config": predictor,
        "num_code_groups": NUM_CODE_GROUPS,
        "thinker_hidden_size": HIDDEN,
        "accept_hidden_layer": 1,
        "codec_eos_token_id": CODEC_EOS,
        "codec_nothink_id": CODEC_NOTHINK,
        "codec_think_bos_id": CODEC_THINK_BOS,
        "codec_think_eos_id": CODEC_THINK_EOS,
        "codec_pad_id": CODEC_PAD,
        "codec_bos_id": CODEC_BOS,
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "spatial_merge_size": 2,
        "speaker_id": dict(SPEAKER_IDS),
        "initializer_range": WEIGHT_STD,
    }


def omni_config_dict(ids: dict[str, int]) -> dict:
    """The ``Qwen3OmniMoeConfig`` keyword arguments of the tiny checkpoint (``ids``: token ids)."""
    code2wav = {
        "codebook_size": CODEBOOK_SIZE,
        "hidden_size": 64,
        "max_position_embeddings": 1024,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_quantizers": NUM_CODE_GROUPS,
        "upsample_rates": [2, 2],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 64,
        "sliding_window": 72,
        "initializer_range": WEIGHT_STD,
    }
    return {
        "thinker_config": _thinker_config(ids),
        "talker_config": _talker_config(ids),
        "code2wav_config": code2wav,
        "enable_audio_output": True,
        "im_start_token_id": ids["<|im_start|>"],
        "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": ids["<|tts_pad|>"],
        "tts_bos_token_id": ids["<|tts_bos|>"],
        "tts_eos_token_id": ids["<|tts_eos|>"],
        "system_token_id": ids["system"],
        "user_token_id": ids["user"],
        "assistant_token_id": ids["assistant"],
    }


def make_tiny_qwen3_omni(path: str | os.PathLike) -> Path:
    """Write the tiny Qwen3-Omni checkpoint into ``path`` (created; files overwritten).

    Returns:
        ``path`` as a :class:`~pathlib.Path`. Files: ``config.json``, ``generation_config.json``,
        ``model.safetensors`` (float32), tokenizer files, ``preprocessor_config.json``,
        ``chat_template.json``.
    """
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from tools.make_tiny_llm import CHAT_TEMPLATE

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, SPECIAL_TOKENS, {"extra_special_tokens": dict(NAMED_TOKENS)})
    cfg = Qwen3OmniMoeConfig(**omni_config_dict(ids))
    write_random_model(out, Qwen3OmniMoeForConditionalGeneration, cfg, ids, MODEL_SEED, WEIGHT_STD)
    _scale_code2wav_output(out / "model.safetensors", len(cfg.code2wav_config.upsample_rates))
    # the image processor: patch 16 (Qwen3-Omni's vision encoder), mean / std 0.5
    image = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "min_pixels": 4096, "max_pixels": 1048576}
    _write_json(
        out / "preprocessor_config.json", preprocessor_config("Qwen3OmniMoeProcessor", patch_size=16, **image)
    )
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    return out


def _scale_code2wav_output(weights: Path, num_upsample_rates: int) -> None:
    """Multiply the code2wav's output convolution (weight and bias) in ``weights`` by
    :data:`CODE2WAV_OUTPUT_SCALE`; every other tensor keeps its bytes.

    The convolution is ``code2wav.decoder[-1]``: after the input convolution, one decoder block per
    upsample rate and a SnakeBeta (transformers' ``Qwen3OmniMoeCode2Wav``). It is linear, so the
    waveform before the clamp scales by exactly that factor.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(weights), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(weights))
    prefix = f"code2wav.decoder.{num_upsample_rates + 2}.conv."
    for name in (prefix + "weight", prefix + "bias"):
        tensors[name] = tensors[name] * CODE2WAV_OUTPUT_SCALE
    save_file(tensors, str(weights), metadata=metadata)


# --------------------------------------------------------------------------------------
# Adapters (peft on the whole model, full module names: see DESIGN.md's peft trap)
# --------------------------------------------------------------------------------------

#: Thinker decoder modules a thinker adapter targets, in both layers (full names: peft 0.21 turns
#: a regex into leaf names and then adapts the audio tower, talker and code2wav too).
THINKER_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
#: MLP projection names. peft 0.21 maps every target ending in one of them, on any Qwen3-Omni
#: model, to the fused expert parameters of every MoE block (its transformers-v5 conversion,
#: ``_MOE_TARGET_MODULE_MAPPING["qwen2_moe"]``), the talker's included, even when the full name
#: is a dense MLP's: an adapter on these names is an expert adapter.
MLP_PROJECTIONS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def thinker_target_modules(modules=THINKER_ATTENTION, layers=(0, 1)) -> list[str]:
    """Full module names ``thinker.model.layers.{i}.{module}`` for every layer and module."""
    return [f"thinker.model.layers.{i}.{module}" for i in layers for module in modules]


def make_thinker_adapter(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules=None,
    seed: int = 606,
) -> Path:
    """Write a PEFT LoRA adapter on the thinker's decoder (whole-model keys,
    ``base_model.model.thinker.model.layers...``) into ``out_dir``.

    Args:
        target_modules: full module names; default :func:`thinker_target_modules` (attention in
            both layers). peft writes ``rank_pattern`` / ``alpha_pattern`` ``{".*\\.gate_up_proj": 2r}``
            into every adapter of this model (its MoE conversion): vLLM checks that rank against
            ``max_lora_rank`` too.

    ``lora_A`` and ``lora_B`` are seeded Gaussian noise (peft's default ``lora_B`` is zero).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3OmniMoeForConditionalGeneration

    full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    targets = list(target_modules) if target_modules is not None else thinker_target_modules()
    lcfg = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(full, lcfg)
    lora = [(n, p) for n, p in peft_model.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    if not lora:
        raise RuntimeError(f"no LoRA parameters were created for target_modules {targets}")
    _fill_random_(lora, seed, WEIGHT_STD)
    return save_adapter(peft_model, out_dir, "tiny-qwen3-omni")


#: Talker modules a talker adapter targets (leaf names, peft on the talker sub-model): attention and the
#: shared expert's MLP of both decoder layers, and the code predictor's attention and MLP. peft does not
#: convert a talker config (``qwen3_omni_moe_talker`` is not in its MoE table), so these names stay
#: ``nn.Linear`` modules; the fused experts (``mlp.experts``) are parameters, reached only through
#: ``target_parameters`` (:data:`TALKER_EXPERT_PARAMETERS`).
TALKER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The talker's fused expert parameters, as peft's ``target_parameters`` names them.
TALKER_EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def make_talker_adapter(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules=TALKER_TARGETS,
    target_parameters=None,
    seed: int = 707,
) -> Path:
    """Write a PEFT LoRA adapter trained (as a user would) with peft on transformers'
    ``Qwen3OmniMoeTalkerForConditionalGeneration`` (the checkpoint's ``talker``): keys
    ``base_model.model.model.layers.{i}...`` and ``base_model.model.code_predictor...``.

    Args:
        target_modules: leaf names (default :data:`TALKER_TARGETS`).
        target_parameters: peft's parameter targets (e.g. :data:`TALKER_EXPERT_PARAMETERS`: an
            adapter on the fused experts, which the talker stage refuses).

    ``lora_A`` and ``lora_B`` are seeded Gaussian noise (peft's default ``lora_B`` is zero).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3OmniMoeForConditionalGeneration

    full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    lcfg = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        target_parameters=None if target_parameters is None else list(target_parameters),
        lora_dropout=0.0,
        bias="none",
    )
    peft_model = get_peft_model(full.talker, lcfg)
    lora = [(n, p) for n, p in peft_model.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    _fill_random_(lora, seed, WEIGHT_STD)
    return save_adapter(peft_model, out_dir, "tiny-qwen3-omni-talker")


# --------------------------------------------------------------------------------------
# Cached assets
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyQwen3OmniAssets:
    model_dir: Path
    thinker_adapter: Path  # attention of both thinker layers
    experts_adapter: Path  # peft's adapter for the MLP names of layer 1: every MoE block's experts
    talker_adapter: Path  # peft on the talker: attention, shared expert, code predictor (TALKER_TARGETS)
    talker_experts_adapter: Path  # peft on the talker: q_proj and the fused experts (target_parameters)


def ensure_tiny_qwen3_omni_assets(root: str | os.PathLike) -> TinyQwen3OmniAssets:
    """Build (only what is missing of) the tiny checkpoint and its adapters under ``root``.

    Safe under pytest-xdist (file lock; temp dir then rename), as :mod:`tools.make_tiny_llm`.
    """
    from filelock import FileLock

    base = Path(root) / f"tiny_qwen3_omni_v{QWEN3_OMNI_ASSETS_VERSION}"
    base.mkdir(parents=True, exist_ok=True)
    assets = TinyQwen3OmniAssets(
        *(base / name for name in ("model", "thinker_adapter", "experts_adapter")),
        base / "talker_adapter",
        base / "talker_experts_adapter",
    )
    mlp = thinker_target_modules(MLP_PROJECTIONS, layers=(1,))
    with FileLock(str(base / ".lock")):
        _atomic_build(assets.model_dir, make_tiny_qwen3_omni)
        _atomic_build(assets.thinker_adapter, lambda tmp: make_thinker_adapter(assets.model_dir, tmp))
        _atomic_build(
            assets.experts_adapter,
            lambda tmp: make_thinker_adapter(assets.model_dir, tmp, target_modules=mlp),
        )
        _atomic_build(assets.talker_adapter, lambda tmp: make_talker_adapter(assets.model_dir, tmp))
        _atomic_build(
            assets.talker_experts_adapter,
            lambda tmp: make_talker_adapter(
                assets.model_dir, tmp, target_modules=("q_proj",), target_parameters=TALKER_EXPERT_PARAMETERS
            ),
        )
    return assets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="directory for the checkpoint")
    parser.add_argument(
        "--adapter", action="store_true", help="also write a thinker and a talker adapter beside it"
    )
    args = parser.parse_args(argv)
    make_tiny_qwen3_omni(args.out)
    print(f"model: {args.out}")
    if args.adapter:
        path = args.out.parent / f"{args.out.name}_thinker_adapter"
        make_thinker_adapter(args.out, path)
        print(f"adapter: {path}")
        talker = args.out.parent / f"{args.out.name}_talker_adapter"
        make_talker_adapter(args.out, talker)
        print(f"talker adapter: {talker}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
