"""Text-encoder LoRA cost per request: ours (one ``DiffusionLoRAManager`` per encoder, what a diffusion stage
builds) vs transformers+peft (what diffusers' ``load_lora_weights`` injects) on the same weights.

One random ``Qwen3Model`` (Z-Image's text-encoder class; sizes from the flags) and one LoRA (rank ``--rank``
on every attention and MLP projection of every layer, alpha = 2 r) written as a diffusers-keyed file
(``text_encoder.<module>.lora_A.weight``, the configuration in the header). A request encodes a CFG pair
(``--tokens`` tokens each: the prompt and its negative text) once. Per side, encodes without and with the
adapter are interleaved (``benchmarks/timing.py`` ``paired``) and the medians of ``--repeats`` reported:

* ours: the encoder wrapped by ``TextEncoderLoRA`` (base: no activation; LoRA: the adapter active on both rows);
* peft: base is the plain encoder, LoRA the encoder with peft's injected layers (``inject_adapter_in_model``).

The ratio LoRA / base per side is the adapter's cost per request; ``ours_vs_peft`` compares the two LoRA
encodes. Run from the repository root (one intra-op thread; CPU time of this process)::

    .venv/bin/python -m benchmarks.text_encoder_lora            # hidden 1024, 4 layers, 256 tokens
    .venv/bin/python -m benchmarks.text_encoder_lora --quick    # hidden 256, 2 layers, 64 tokens
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import tempfile
import types
from pathlib import Path

from benchmarks.denoiser_pair import emit
from benchmarks.timing import Timer, paired

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _models(hidden: int, layers: int, rank: int, seed: int = 0):
    """``(plain encoder, peft encoder, diffusers-keyed file state dict, metadata)`` on the same weights."""
    import torch
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    heads = max(1, hidden // 64)
    config = Qwen3Config(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=64,
        vocab_size=4096,
    )
    plain = Qwen3Model(config).eval().requires_grad_(False)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    peft_model = inject_adapter_in_model(lora, copy.deepcopy(plain)).eval().requires_grad_(False)
    state = {f"text_encoder.{k}": v.clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    meta = {
        "lora_adapter_metadata": json.dumps({"text_encoder.r": rank, "text_encoder.lora_alpha": 2 * rank})
    }
    return plain, peft_model, state, meta


def run(args) -> dict:
    import torch
    from safetensors.torch import save_file

    from vllm_omni.diffusion.lora.text_encoder_lora import TextEncoderLoRA
    from vllm_omni.lora.request import LoRARequest

    torch.set_num_threads(1)
    plain, peft_model, state, meta = _models(args.hidden, args.layers, args.rank)
    ours = copy.deepcopy(plain)
    te = TextEncoderLoRA(
        types.SimpleNamespace(text_encoder=ours), "benchmark", max_loras=1, max_rank=args.rank
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "te.safetensors")
        save_file(state, path, metadata=meta)
        request = LoRARequest("te", 1, path)
        te.read(path)  # what the denoiser managers' loader does: keeps the text-encoder part
        te.note_loaded([request])
        te.managers["text_encoder"].add_lora(request)
        te.done_loading()
    manager = te.managers["text_encoder"]
    ids = torch.randint(0, 4096, (2, args.tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    current = {"peft": plain}

    def encode(model):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, output_hidden_states=True)

    sides = {
        "ours": (
            lambda: encode(ours),
            manager.deactivate,
            lambda: manager.set_active_adapters([[request], [request]], [[1.0], [1.0]]),
        ),
        "peft": (
            lambda: encode(current["peft"]),
            lambda: current.update(peft=plain),
            lambda: current.update(peft=peft_model),
        ),
    }
    manager.set_active_adapters([[request], [request]], [[1.0], [1.0]])
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        want = peft_model(input_ids=ids, attention_mask=mask).last_hidden_state
    parity = (got - want).abs().max().item()
    timer = Timer("cpu", "cpu")
    res = paired(timer, sides, args.repeats, warm_base=True)
    for side in res.values():
        side.pop("base_samples_s")
        side.pop("lora_samples_s")
    return {
        "machine": platform.processor() or platform.machine(),
        "threads": 1,
        "clock": "process CPU time",
        "encoder": f"Qwen3Model hidden {args.hidden}, {args.layers} layers, CFG pair of {args.tokens} tokens",
        "lora": f"rank {args.rank} on {TARGETS} of every layer",
        "parity_max_abs_diff": parity,
        "sides": res,
        "ours_vs_peft_lora_encode": res["ours"]["lora_s"] / res["peft"]["lora_s"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="hidden 256, 2 layers, 64 tokens, 3 repeats")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.tokens, args.repeats = 256, 2, 64, 3
    return emit(run(args), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
