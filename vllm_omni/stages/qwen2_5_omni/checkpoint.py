"""Views of a Qwen2.5-Omni checkpoint that stock vLLM runs, and the tables the talker's inputs need.

vLLM 0.32 runs the Omni *thinker* only. The talker's decoder and the thinker's text decoder
are plain Qwen2 decoders (their multimodal rotary embedding reduces to the ordinary one on
text positions, where its three position rows are equal), so each is exposed to vLLM as a
derived ``Qwen2ForCausalLM`` directory:

* talker: ``talker.model.*`` -> ``model.*``, ``talker.codec_head`` -> ``lm_head``; its
  ``embed_tokens`` holds the codec embedding already projected by ``thinker_to_talker_proj``
  (the stage feeds projected ``prompt_embeds``; vLLM never looks the table up);
* thinker text: ``thinker.model.*`` -> ``model.*``, ``thinker.lm_head`` -> ``lm_head``
  (the pooling pass that returns the thinker's final hidden states).

Derived directories are written once per checkpoint (keyed by its path, size and mtime)
under ``$VLLM_OMNI_CACHE_DIR`` (default ``~/.cache/vllm_omni``) / ``derived``. An adapter
trained with peft on the thinker sub-model of transformers' full model (module names
``thinker.model.layers...``) or on the talker sub-model is re-keyed the same way
(:func:`derive_adapter`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vllm_omni.errors import ConfigError, LoRAFormatError

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
)


def cache_root() -> str:
    return os.path.join(
        os.environ.get("VLLM_OMNI_CACHE_DIR") or os.path.expanduser("~/.cache/vllm_omni"), "derived"
    )


def omni_config(model_dir: str) -> dict[str, Any]:
    """The ``config.json`` of an Omni checkpoint.

    Raises:
        ConfigError: unreadable, or not a ``qwen2_5_omni`` config with thinker and talker.
    """
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{model_dir}: cannot read config.json: {exc}") from exc
    if not isinstance(cfg, dict) or "thinker_config" not in cfg or "talker_config" not in cfg:
        raise ConfigError(f"{model_dir} is not a Qwen2.5-Omni checkpoint with a talker (config.json)")
    return cfg


def _weight_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ConfigError(f"{model_dir}: no *.safetensors weights")
    return files


def load_prefixed(model_dir: str, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with ``prefix``, renamed without it (CPU, stored dtype)."""
    out: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key.startswith(prefix):
                    out[key[len(prefix) :]] = f.get_tensor(key)
    return out


def _fingerprint(*paths: str) -> str:
    h = hashlib.sha1()
    for path in paths:
        for f in sorted(glob.glob(os.path.join(path, "*"))) if os.path.isdir(path) else [path]:
            st = os.stat(f)
            h.update(f"{os.path.realpath(f)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def _write_once(dest: str, write) -> str:
    """``dest`` (a directory); built by ``write(tmpdir)`` and renamed into place when missing."""
    if os.path.isdir(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=".tmp-")
    try:
        write(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process won the race: use its copy
            if not os.path.isdir(dest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _qwen2_config(text: dict[str, Any], vocab_size: int, dtype: str) -> dict[str, Any]:
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    head_dim = text.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ConfigError(
            f"Qwen2.5-Omni decoder with head_dim {head_dim} x {heads} heads != hidden_size {hidden}: "
            "vLLM's Qwen2 cannot run it"
        )
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    keys = ("intermediate_size", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps")
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        **{k: text[k] for k in keys},
        "hidden_act": text.get("hidden_act", "silu"),
        "max_position_embeddings": int(text.get("max_position_embeddings", 32768)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(theta)},
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "dtype": dtype,
    }


def _save_model(tmp: str, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(tmp, "model.safetensors"))


def derive_talker_checkpoint(model_dir: str) -> str:
    """The talker as a ``Qwen2ForCausalLM`` directory (see the module docstring); its path."""
    cfg = omni_config(model_dir)
    dest = os.path.join(cache_root(), f"talker-{_fingerprint(model_dir)}")

    def write(tmp: str) -> None:
        talker = cfg["talker_config"]
        model = load_prefixed(model_dir, "talker.model.")
        proj = load_prefixed(model_dir, "talker.thinker_to_talker_proj.")
        head = load_prefixed(model_dir, "talker.codec_head.")
        weights = {f"model.{k}": v for k, v in model.items()}
        codec = model["embed_tokens.weight"].float()
        weights["model.embed_tokens.weight"] = torch.nn.functional.linear(
            codec, proj["weight"].float(), proj["bias"].float()
        ).to(codec.dtype)
        weights["lm_head.weight"] = head["weight"]
        dtype = str(cfg.get("dtype") or talker.get("dtype") or "float32")
        _save_model(tmp, _qwen2_config(talker, talker["vocab_size"], dtype), weights)

    return _write_once(dest, write)


def derive_adapter(adapter_dir: str, sub_model: str) -> str:
    """A peft adapter of the Omni ``sub_model`` (``"thinker"`` / ``"talker"``) keyed for its derived
    Qwen2 directory: ``<sub_model>.model.`` -> ``model.``; ``<sub_model>.codec_head`` -> ``lm_head``.
    Adapters already keyed ``base_model.model.model.layers...`` are copied unchanged.

    Raises:
        LoRAFormatError: no ``adapter_model.safetensors``, or a module that has no counterpart
            (e.g. the audio encoder, ``thinker_to_talker_proj``): binding nothing there would be silent.
    """
    src = os.path.join(adapter_dir, "adapter_model.safetensors")
    if not os.path.isfile(src):
        raise LoRAFormatError(f"{adapter_dir}: no adapter_model.safetensors")
    dest = os.path.join(cache_root(), f"adapter-{sub_model}-{_fingerprint(adapter_dir)}")

    def write(tmp: str) -> None:
        out = {}
        for key, value in load_file(src).items():
            new = key.replace(f".{sub_model}.model.", ".model.").replace(
                f".{sub_model}.codec_head.", ".lm_head."
            )
            if not new.startswith("base_model.model.model.layers.") and ".lm_head." not in new:
                raise LoRAFormatError(
                    f"{adapter_dir}: tensor {key!r} adapts a module outside the {sub_model}'s decoder "
                    "layers; target the decoder's linear layers only"
                )
            out[new] = value
        save_file(out, os.path.join(tmp, "adapter_model.safetensors"))
        shutil.copy(os.path.join(adapter_dir, "adapter_config.json"), tmp)

    return _write_once(dest, write)


@dataclass(frozen=True)
class TalkerTables:
    """What building the talker's input embeddings needs besides the thinker's hidden states.

    Attributes:
        thinker_embed: the thinker's token embedding, float32 ``[V_text, E]``.
        codec_embed: the talker's codec embedding, float32 ``[V_codec, E]``.
        proj_weight / proj_bias: ``thinker_to_talker_proj`` (``E -> H``), float32.
        ids: the talker config's special ids (``tts_text_*``, ``tts_codec_*``) and the thinker's
            multimodal placeholder ids (``audio_token_index`` ...).
    """

    thinker_embed: torch.Tensor
    codec_embed: torch.Tensor
    proj_weight: torch.Tensor
    proj_bias: torch.Tensor
    ids: dict[str, int]

    @classmethod
    def load(cls, model_dir: str) -> TalkerTables:
        cfg = omni_config(model_dir)
        talker = cfg["talker_config"]
        proj = load_prefixed(model_dir, "talker.thinker_to_talker_proj.")
        names = [k for k in talker if k.startswith("tts_") or k.endswith("_token_index")]
        return cls(
            load_prefixed(model_dir, "thinker.model.embed_tokens.")["weight"].float(),
            load_prefixed(model_dir, "talker.model.embed_tokens.")["weight"].float(),
            proj["weight"].float(),
            proj["bias"].float(),
            {k: int(talker[k]) for k in names},
        )

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``thinker_to_talker_proj(x)``: float32 ``[..., E] -> [..., H]``."""
        return torch.nn.functional.linear(x, self.proj_weight, self.proj_bias)
