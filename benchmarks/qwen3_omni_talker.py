"""Per-codec-token cost of Qwen3-Omni's talker stage against transformers' own decode loop.

The talker stage (``vllm_omni.stages.qwen3_omni.talker``) runs transformers' talker ``generate``
(each step: the MoE decoder, then the code predictor for the residual codebooks) on its driver
thread. This harness times, on one checkpoint and the same inputs, one request through the stage
(``submit`` -> result: input building, queue, ``generate``, codes) and transformers' ``generate``
called directly, each forced to ``--codes`` steps (``min_tokens == max_tokens``), greedy; medians
over ``--rounds``, the two timed in turn within each round. The ratio is the stage's overhead over transformers' loop.

Run from the repository root::

    .venv/bin/python -m benchmarks.qwen3_omni_talker [--model DIR] [--codes 32] [--json out.json]

Without ``--model`` the tiny test checkpoint is built under ``.cache/test_assets``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent


def _interleaved_medians(fns, rounds: int) -> list[float]:
    """Median seconds of each of ``fns``, timed in turn within every round (a loaded machine
    slows both alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, acc in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(acc) for acc in times]


def run(model_dir: str, codes: int, reply: int, rounds: int) -> dict:
    """``{"stage_ms_per_code", "transformers_ms_per_code", "ratio", ...}`` (see the module docstring)."""
    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_omni.engine.connectors import StagePayload
    from vllm_omni.inputs.stage_request import StageRequest
    from vllm_omni.stages.qwen3_omni.talker import TalkerStageEngine, build_talker_inputs, generate_kwargs

    stage = SimpleNamespace(
        stage_id=1, label="Stage 1 (llm_ar)", model=model_dir, stage_type="llm_ar", lora_config=None
    )
    talker = TalkerStageEngine(stage)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "user", "content": "Once upon a time"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    prompt = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
    reply_ids = torch.arange(100, 100 + reply)
    params = SamplingParams(temperature=0.0, max_tokens=codes, min_tokens=codes)
    payload = StagePayload({"prompt_token_ids": prompt, "output_token_ids": reply_ids}, {"voice": "Ethan"})

    def through_stage():
        out = talker.submit(StageRequest(payload, params)).result()
        assert out.codes.shape[1] == codes - 1, out.codes.shape  # the first step is the prefill's

    speaker = talker.ids.speakers["ethan"]
    kwargs = generate_kwargs(params, talker.vocab, talker.ids.codec_eos)

    @torch.inference_mode()
    def direct():
        inputs = build_talker_inputs(talker.model, talker.embed, talker.ids, prompt, reply_ids, speaker)
        talker.model.generate(**inputs, attention_mask=torch.ones_like(inputs["talker_input_ids"]), **kwargs)

    through_stage()  # warm-up (first-call allocations) for both paths
    direct()
    stage_s, direct_s = _interleaved_medians((through_stage, direct), rounds)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="Qwen3-Omni checkpoint (default: the tiny test one)")
    parser.add_argument("--codes", type=int, default=32, help="codec steps per request")
    parser.add_argument("--reply", type=int, default=16, help="thinker reply tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        sys.path.insert(0, str(REPO))
        from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets

        model = str(ensure_tiny_qwen3_omni_assets(REPO / ".cache" / "test_assets").model_dir)
    result = run(model, args.codes, args.reply, args.rounds)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
