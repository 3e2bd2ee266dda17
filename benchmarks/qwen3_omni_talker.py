"""Per-codec-token cost of Qwen3-Omni's talker stage against transformers' own decode loop.

The talker stage (``vllm_omni.stages.qwen3_omni.talker``) runs transformers' talker ``generate``
(each step: the MoE decoder, then the code predictor for the residual codebooks) on its driver
thread. This harness times, on one checkpoint and the same inputs, one request through the stage
(``submit`` -> result: input building, queue, ``generate``, codes) and transformers' ``generate``
called directly, each forced to ``--codes`` steps (``min_tokens == max_tokens``), greedy; medians
over ``--rounds``, the two timed in turn within each round. The ratio is the stage's overhead over transformers' loop.

``--lora`` instead times the cost of a talker adapter (``--adapter``, default the tiny talker adapter):
on a stage with ``enable_lora``, one request with the adapter against one without (``lora_ratio``), and
transformers' ``generate`` with peft's LoRA layers (``PeftModel.from_pretrained`` on a second copy of the
talker) on the same inputs (``lora_vs_peft``: the stage with the adapter over peft), all timed in turn.

Run from the repository root::

    .venv/bin/python -m benchmarks.qwen3_omni_talker [--model DIR] [--codes 32] [--lora] [--json out.json]

Without ``--model`` the tiny test checkpoint (and its talker adapter) is built under ``.cache/test_assets``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks.timing import interleaved_medians

REPO = Path(__file__).resolve().parent.parent


def _talker_and_request(model_dir: str, codes: int, reply: int, lora_config=None):
    """``(talker stage, prompt ids, reply ids, params, payload)`` for ``--codes`` forced greedy steps."""
    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_omni.engine.connectors import StagePayload
    from vllm_omni.stages.qwen3_omni.talker import TalkerStageEngine

    stage = SimpleNamespace(
        stage_id=1,
        label="Stage 1 (llm_ar)",
        model=model_dir,
        stage_type="llm_ar",
        lora_config=lora_config,
        options={},
    )
    talker = TalkerStageEngine(stage)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "user", "content": "Once upon a time"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    prompt = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
    reply_ids = torch.arange(100, 100 + reply)
    params = SamplingParams(temperature=0.0, max_tokens=codes, min_tokens=codes)
    payload = StagePayload({"prompt_token_ids": prompt, "output_token_ids": reply_ids}, {"voice": "Ethan"})
    return talker, prompt, reply_ids, params, payload


def _stage_call(talker, payload, params, codes: int, lora=None):
    """One request through the stage (``lora``: its talker adapter), checked to have run every step."""
    from vllm_omni.inputs.stage_request import StageRequest
    from vllm_omni.lora.request import RequestAdapters

    def call():
        out = talker.submit(StageRequest(payload, params, RequestAdapters.of(lora))).result()
        assert out.codes.shape[1] == codes - 1, out.codes.shape  # the first step is the prefill's

    return call


def run(model_dir: str, codes: int, reply: int, rounds: int) -> dict:
    """``{"stage_ms_per_code", "transformers_ms_per_code", "ratio", ...}`` (see the module docstring)."""
    import torch

    from vllm_omni.stages.qwen3_omni.talker import build_talker_inputs, generate_kwargs

    talker, prompt, reply_ids, params, payload = _talker_and_request(model_dir, codes, reply)
    through_stage = _stage_call(talker, payload, params, codes)

    speaker = talker.ids.speakers["ethan"]
    kwargs = generate_kwargs(params, talker.vocab, talker.ids.codec_eos)

    @torch.inference_mode()
    def direct():
        inputs = build_talker_inputs(talker.model, talker.embed, talker.ids, prompt, reply_ids, speaker)
        talker.model.generate(**inputs, attention_mask=torch.ones_like(inputs["talker_input_ids"]), **kwargs)

    through_stage()  # warm-up (first-call allocations) for both paths
    direct()
    stage_s, direct_s = interleaved_medians((through_stage, direct), rounds)
    talker.shutdown()
    return {
        "codes": codes,
        "reply_tokens": reply,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "stage_ms_per_code": round(1000 * stage_s / codes, 3),
        "transformers_ms_per_code": round(1000 * direct_s / codes, 3),
        "ratio": round(stage_s / direct_s, 3),
    }


def run_lora(model_dir: str, adapter: str, codes: int, reply: int, rounds: int) -> dict:
    """``{"lora_ms_per_code", "base_ms_per_code", "peft_ms_per_code", "lora_ratio", "lora_vs_peft", ...}``."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )

    from vllm_omni.config.lora import OmniStageLoRAConfig
    from vllm_omni.lora.request import LoRARequest
    from vllm_omni.stages.model_driver import load_submodule
    from vllm_omni.stages.qwen3_omni.talker import build_talker_inputs, fuse_experts, generate_kwargs

    config = OmniStageLoRAConfig(max_lora_rank=64, max_loras=1)
    talker, prompt, reply_ids, params, payload = _talker_and_request(model_dir, codes, reply, config)
    lora = LoRARequest("talker", 1, adapter)
    with_adapter = _stage_call(talker, payload, params, codes, lora)
    without = _stage_call(talker, payload, params, codes)
    sub_config = AutoConfig.from_pretrained(model_dir).talker_config
    module = load_submodule(
        Qwen3OmniMoeTalkerForConditionalGeneration, sub_config, model_dir, "talker.", fuse_experts
    )
    peft_talker = PeftModel.from_pretrained(module, adapter).eval()
    speaker = talker.ids.speakers["ethan"]
    kwargs = generate_kwargs(params, talker.vocab, talker.ids.codec_eos)

    @torch.inference_mode()
    def peft_direct():
        inputs = build_talker_inputs(module, talker.embed, talker.ids, prompt, reply_ids, speaker)
        peft_talker.generate(**inputs, attention_mask=torch.ones_like(inputs["talker_input_ids"]), **kwargs)

    for fn in (with_adapter, without, peft_direct):  # warm-up
        fn()
    lora_s, base_s, peft_s = interleaved_medians((with_adapter, without, peft_direct), rounds)
    talker.shutdown()
    return {
        "codes": codes,
        "reply_tokens": reply,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "adapter": adapter,
        "lora_ms_per_code": round(1000 * lora_s / codes, 3),
        "base_ms_per_code": round(1000 * base_s / codes, 3),
        "peft_ms_per_code": round(1000 * peft_s / codes, 3),
        "lora_ratio": round(lora_s / base_s, 3),
        "lora_vs_peft": round(lora_s / peft_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="Qwen3-Omni checkpoint (default: the tiny test one)")
    parser.add_argument("--codes", type=int, default=32, help="codec steps per request")
    parser.add_argument("--reply", type=int, default=16, help="thinker reply tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--lora", action="store_true", help="time a talker adapter (see the docstring)")
    parser.add_argument("--adapter", help="talker adapter for --lora (default: the tiny one)")
    args = parser.parse_args(argv)
    model, adapter = args.model, args.adapter
    if model is None or (args.lora and adapter is None):
        sys.path.insert(0, str(REPO))
        from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets

        assets = ensure_tiny_qwen3_omni_assets(REPO / ".cache" / "test_assets")
        model, adapter = model or str(assets.model_dir), adapter or str(assets.talker_adapter)
    if args.lora:
        result = run_lora(model, adapter, args.codes, args.reply, args.rounds)
    else:
        result = run(model, args.codes, args.reply, args.rounds)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
