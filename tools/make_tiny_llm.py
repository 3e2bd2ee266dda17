"""Deterministic writer of a tiny Qwen2 causal LM (HF format) plus PEFT LoRA adapters for it.

The model directory is loadable by ``transformers.AutoModelForCausalLM`` /
``AutoTokenizer`` and by ``vllm.LLM``. Everything is built locally (no hub
access): the tokenizer is a byte-level BPE trained on a small built-in English
corpus, the weights are random with a fixed seed, and the adapters carry random
(non-zero) ``lora_A``/``lora_B`` so that they visibly change greedy outputs.

Running the builder twice gives byte-identical files.

CLI::

    python -m tools.make_tiny_llm --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

# --------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

#: Number of ordinary (byte + merge) tokens; the 3 special tokens come after them.
BPE_VOCAB_SIZE = 509

#: Same pre-tokenization regex as Qwen2's tokenizer, so that transformers' Qwen2Tokenizer
#: (which rebuilds its pipeline from vocab/merges) tokenizes exactly like tokenizer.json.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MODEL_SEED = 1234
#: Std of the random weights. Much larger than the usual 0.02 so that the logits are
#: peaked (greedy decoding depends on the context instead of repeating one token) and
#: argmax margins are large enough for exact HF/vLLM parity.
WEIGHT_STD = 0.15
LORA_STD = 0.15

TINY_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head_dim 32: smallest head size the vLLM CPU attention backend takes
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "initializer_range": WEIGHT_STD,
    "use_sliding_window": False,
}

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR_MODULES = ATTN_MODULES + MLP_MODULES

# Adapter specs used by the test assets.
ADAPTER_A = {"r": 8, "lora_alpha": 16, "target_modules": ("q_proj", "v_proj"), "seed": 101}
ADAPTER_B = {"r": 16, "lora_alpha": 16, "target_modules": ALL_LINEAR_MODULES, "seed": 202}
ADAPTER_RANK64 = {"r": 64, "lora_alpha": 64, "target_modules": ("q_proj", "v_proj"), "seed": 303}

#: Bump when the output of the builders changes, so stale cached assets get rebuilt.
ASSETS_VERSION = "1"

# A small original English corpus for the BPE merges.
CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the gate.
Once upon a time there was a small village at the edge of a quiet forest.
The people of the village worked in the fields during the day and told stories at night.
A young girl named Mira liked to read books about the stars, the sea and the mountains.
Every morning she walked to the river to fetch water and to listen to the birds singing.
One day she found an old map hidden under a stone near the bridge.
The map showed a path through the forest to a tower that nobody had seen for a hundred years.
She asked her brother to come with her, but he said that the forest was too dark and too deep.
So she packed some bread, an apple, a candle and a warm coat, and she went alone.
The trees were tall and the light was green and soft, and the ground was covered with leaves.
After many hours she reached the tower, which was made of grey stone and covered with ivy.
Inside there was a library with thousands of books, and a window that looked at the sky.
She opened the first book and read about the history of the stars and the names of the planets.
When the night came she lit the candle and kept reading until the morning light returned.
Then she went back home and told everyone what she had found in the forest.
The weather today is sunny with a light wind from the west and a few clouds in the afternoon.
Tomorrow it will rain in the morning, but the evening should be clear and warm.
Please remember to bring your umbrella if you are going to the city center.
The train leaves the station at nine o'clock and arrives in the capital two hours later.
Tickets can be bought online, at the machines in the hall, or from the staff on the platform.
Computers process information by following instructions written in programming languages.
A program reads input, performs a computation and writes output to the screen or to a file.
Good software is tested carefully, because small mistakes can cause large problems later.
The engineer wrote a function that returns the sum of two numbers and another that sorts a list.
Models that generate text predict the next token given all of the previous tokens.
Water boils at one hundred degrees and freezes at zero degrees at normal pressure.
The heart pumps blood through the body, and the lungs bring oxygen into the blood.
Plants use sunlight, water and air to make sugar and to grow new leaves and flowers.
In the kitchen, the cook cut the onions, heated the oil and added the vegetables to the pan.
She said: "I don't know where they're going, but I'll follow them if you've got a light."
What is your name? Where do you live? How old are you? Why is the sky blue?
There are 7 days in a week, 12 months in a year, and 365 days in most years.
The meeting will start at 10:30 and should finish before 12:00, so please be on time.
Music, painting and dance are forms of art that people have loved for thousands of years.
The children played in the garden, laughing and running after the ball until it was dark.
"""

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json")


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def _train_bpe(special_tokens: tuple[str, ...] = SPECIAL_TOKENS):
    """Train the byte-level BPE (deterministic) and return a ``tokenizers.Tokenizer``.

    ``special_tokens`` are appended after the ``BPE_VOCAB_SIZE`` ordinary tokens, in order.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(
        BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")


def write_tokenizer(
    out_dir: str | os.PathLike,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    extra_config: dict | None = None,
) -> dict[str, int]:
    """Write tokenizer files into ``out_dir``; return the special token ids.

    Args:
        special_tokens: the special tokens (ids ``BPE_VOCAB_SIZE`` on, in order); must hold
            ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>``.
        extra_config: extra ``tokenizer_config.json`` entries (e.g. named multimodal tokens).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_bpe(special_tokens)

    tok.save(str(out / "tokenizer.json"), pretty=True)
    # vocab.json / merges.txt in the GPT-2/Qwen2 slow-tokenizer format (ordinary tokens only).
    tok_json = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tok_json["model"]["vocab"]
    merges = tok_json["model"]["merges"]
    _write_json(out / "vocab.json", vocab)
    merge_lines = [m if isinstance(m, str) else " ".join(m) for m in merges]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merge_lines) + "\n", encoding="utf-8")

    special_ids = {t: tok.token_to_id(t) for t in special_tokens}
    added_tokens_decoder = {
        str(special_ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in special_tokens
    }
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [t for t in special_tokens if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
        **(extra_config or {}),
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": tokenizer_config["additional_special_tokens"],
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
        },
    )
    return special_ids


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


def tiny_qwen2_config(vocab_size: int, special_ids: dict[str, int]):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=special_ids["<|endoftext|>"],
        eos_token_id=special_ids[EOS_TOKEN],
        pad_token_id=special_ids[PAD_TOKEN],
        **TINY_CONFIG,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.dtype = "float32"
    return cfg


def _fill_random_(params, seed: int, std: float) -> None:
    """Deterministically overwrite ``params`` ((name, tensor) pairs, sorted by name)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(params, key=lambda kv: kv[0]):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def build_tiny_llm(out_dir: str | os.PathLike) -> Path:
    """Write the tiny Qwen2 model + tokenizer into ``out_dir`` (created / overwritten)."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special_ids = write_tokenizer(out)
    vocab_size = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)
    assert max(special_ids.values()) == vocab_size - 1, special_ids

    cfg = tiny_qwen2_config(vocab_size, special_ids)
    torch.manual_seed(MODEL_SEED)
    model = Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    params = dict(model.named_parameters())
    norms = [(n, p) for n, p in params.items() if n.endswith("norm.weight")]
    biases = [(n, p) for n, p in params.items() if n.endswith(".bias")]
    weights = [(n, p) for n, p in params.items() if n not in dict(norms) and n not in dict(biases)]
    _fill_random_(weights, MODEL_SEED, WEIGHT_STD)
    _fill_random_(biases, MODEL_SEED + 1, WEIGHT_STD)
    with torch.no_grad():
        for _, p in norms:
            p.fill_(1.0)

    model.generation_config = GenerationConfig(
        bos_token_id=special_ids["<|endoftext|>"],
        eos_token_id=[special_ids[EOS_TOKEN], special_ids["<|endoftext|>"]],
        pad_token_id=special_ids[PAD_TOKEN],
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    return out


# --------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------


def build_adapter(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    r: int,
    lora_alpha: int,
    target_modules,
    seed: int,
    use_rslora: bool = False,
) -> Path:
    """Write a PEFT LoRA adapter for the model in ``model_dir`` into ``out_dir``.

    Both ``lora_A`` and ``lora_B`` are filled with seeded Gaussian noise, so the
    adapter changes the model output (PEFT's default init has ``lora_B == 0``).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lcfg = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=sorted(target_modules),
        lora_dropout=0.0,
        bias="none",
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, lcfg)
    lora_params = [(n, p) for n, p in peft_model.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    assert lora_params, "no LoRA parameters were created"
    # Scale so that B @ A has entries of order LORA_STD**2 * sqrt(r), comparable to the base weights.
    _fill_random_(lora_params, seed, LORA_STD)
    peft_model.save_pretrained(out, safe_serialization=True)

    # Make adapter_config.json independent of where the model lives (determinism).
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = "tiny-qwen2"
    if isinstance(cfg.get("target_modules"), list):  # PEFT stores a set: order varies per process
        cfg["target_modules"] = sorted(cfg["target_modules"])
    _write_json(cfg_path, dict(sorted(cfg.items())))
    readme = out / "README.md"
    if readme.exists():
        readme.unlink()
    return out


def write_adapter(
    base_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    r: int,
    alpha: int,
    targets,
    seed: int,
    use_rslora: bool = False,
) -> Path:
    """Positional-argument convenience wrapper around :func:`build_adapter`."""
    return build_adapter(
        base_dir, out_dir, r=r, lora_alpha=alpha, target_modules=targets, seed=seed, use_rslora=use_rslora
    )


def build_rank64_adapter(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A rank-64 adapter: rejected by an engine started with ``max_lora_rank=16``."""
    return build_adapter(model_dir, out_dir, **ADAPTER_RANK64)


# --------------------------------------------------------------------------------------
# Cached assets
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyLLMAssets:
    model_dir: Path
    adapter_a: Path
    adapter_b: Path
    adapter_rank64: Path


def _atomic_build(final: Path, builder) -> Path:
    """Run ``builder(tmp_dir)`` and move the result to ``final`` (caller holds the lock)."""
    if (final / ".complete").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp creates 0700
        builder(tmp)
        (tmp / ".complete").write_text(ASSETS_VERSION + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_tiny_llm_assets(root: str | os.PathLike) -> TinyLLMAssets:
    """Build (only what is missing of) the tiny model and its adapters under ``root``.

    Safe to call from several processes at once (pytest-xdist): guarded by a file lock,
    and every directory is written to a temp dir first and then renamed into place.
    """
    from filelock import FileLock

    base = Path(root) / f"tiny_llm_v{ASSETS_VERSION}"
    base.mkdir(parents=True, exist_ok=True)
    assets = TinyLLMAssets(
        model_dir=base / "model",
        adapter_a=base / "adapter_a",
        adapter_b=base / "adapter_b",
        adapter_rank64=base / "adapter_rank64",
    )
    with FileLock(str(base / ".lock")):
        _atomic_build(assets.model_dir, build_tiny_llm)
        # Adapters depend on the model: rebuild them if the model was rebuilt after them.
        for path, spec in (
            (assets.adapter_a, ADAPTER_A),
            (assets.adapter_b, ADAPTER_B),
            (assets.adapter_rank64, ADAPTER_RANK64),
        ):
            _atomic_build(path, lambda tmp, spec=spec: build_adapter(assets.model_dir, tmp, **spec))
    return assets


def hash_dir(path: str | os.PathLike, pattern: str = "*") -> dict[str, str]:
    """sha256 of every file matching ``pattern`` in ``path`` (non-recursive), by name."""
    out = {}
    for f in sorted(Path(path).glob(pattern)):
        if f.is_file():
            out[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path, help="root directory for the assets")
    args = parser.parse_args(argv)
    assets = ensure_tiny_llm_assets(args.out)
    for name, path in vars(assets).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
