"""Cost of Qwen2.5-Omni's hidden-state hand-off (thinker -> talker), per request.

vLLM 0.32 gives no per-token hidden states from generation, so the talker stage runs a pooling
pass of the thinker's text decoder over ``prompt + output[:-1]`` (``vllm_omni.stages.qwen2_5_omni.talker``).
This harness runs the ``qwen2_5_omni`` pipeline on one checkpoint and times, per request, each
part on its own runtime, one request at a time (medians over ``--rounds``):

- ``thinker``: the thinker's generation (stage 0);
- ``pooling``: the hidden-state pass the hand-off adds (its ratio to ``thinker`` is the headline);
- ``talker``: the talker's decoding (one vLLM request per codec token) and its per-token cost;
- ``code2wav``: the waveform.

Run from the repository root::

    .venv/bin/python -m benchmarks.omni_handoff [--model DIR] [--json out.json]

Without ``--model`` the tiny test checkpoint is built under ``.cache/test_assets``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = ((8, 8), (64, 8), (64, 32), (192, 32))  # (prompt tokens, thinker tokens)
TALKER_TOKENS = 32


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_case(omni, prompt_len: int, think: int, rounds: int) -> dict:
    """Median seconds of each part of one request (see the module docstring)."""
    from vllm import PoolingParams, SamplingParams

    from vllm_omni.inputs.audio import AudioParams
    from vllm_omni.inputs.stage_request import StageRequest
    from vllm_omni.stages.qwen2_5_omni.pipeline import thinker2talker

    thinker, talker, code2wav = omni._orchestrator.runtimes
    prompt = {"prompt_token_ids": [5 + (i % 200) for i in range(prompt_len)]}
    audio = AudioParams(seed=0, num_steps=4)
    times: dict[str, list[float]] = {"thinker": [], "pooling": [], "talker": [], "code2wav": []}
    per_token = []
    for _ in range(rounds):
        sp = SamplingParams(temperature=0, max_tokens=think, ignore_eos=True)
        t, out = _timed(lambda sp=sp: thinker.submit(StageRequest(prompt, sp)).result())
        times["thinker"].append(t)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1]
        t, _ = _timed(
            lambda ids=ids: talker.states.submit(
                StageRequest({"prompt_token_ids": ids}, PoolingParams(task="token_embed"))
            ).result()
        )
        times["pooling"].append(t)
        payload = thinker2talker(out, [None, None, audio], None)
        tp = SamplingParams(temperature=0, max_tokens=TALKER_TOKENS, stop_token_ids=[-1])
        t, res = _timed(lambda payload=payload, tp=tp: talker.submit(StageRequest(payload, tp)).result())
        times["talker"].append(t)
        per_token.append(t / max(1, res.codes.numel()))
        t, _ = _timed(lambda res=res: code2wav.submit(StageRequest(res.payload, audio)).result())
        times["code2wav"].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "prompt_tokens": prompt_len,
        "thinker_tokens": think,
        **{f"{k}_s": round(v, 4) for k, v in med.items()},
        "pooling_over_thinker": round(med["pooling"] / med["thinker"], 3),
        "talker_s_per_token": round(statistics.median(per_token), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Qwen2.5-Omni checkpoint (default: the tiny one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    model = args.model
    if model is None:
        from tools.make_tiny_qwen2_5_omni import ensure_tiny_omni_assets

        root = os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO / ".cache" / "test_assets"
        model = str(ensure_tiny_omni_assets(root).model_dir)
    from vllm_omni import Omni

    stage = {"dtype": "float32", "max_model_len": 512}
    with Omni(model, pipeline="qwen2_5_omni", stage_overrides={"0": stage, "1": stage}) as omni:
        run_case(omni, 8, 4, 1)  # warm-up
        rows = [run_case(omni, p, t, args.rounds) for p, t in CASES]
    cols = list(rows[0])
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
