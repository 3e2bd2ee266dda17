"""Per-codec-token cost of Qwen2.5-Omni's talker stage, before and after "one request per reply",
against transformers' own decode loop on the same weights; and the thinker weights each design holds.

The talker stage (``vllm_omni.stages.qwen2_5_omni.talker``) decodes a whole reply as one vLLM request,
the stepping worker (``vllm_omni.engine.step_io``) adding each step's reply-stream row to the input
embeddings. Before that, it ran one vLLM request of one token per codec token over the embeddings so
far (``prompt_embeds``, prefix caching keyed by the embeddings), and a second vLLM engine (pooling)
holding a copy of the thinker's text decoder recomputed the thinker's hidden states.

This harness builds the ``qwen2_5_omni`` pipeline (float32) on one checkpoint, runs the thinker stage
once (greedy, ``--reply`` tokens) for the talker's payload (its hidden states come from the thinker's
own pass), then times, greedy and forced to ``--codes`` codes, within each of ``--rounds`` in turn
(medians; a loaded machine slows all alike):

- ``after``: one ``talker.submit`` (``min_tokens == max_tokens == codes``): one vLLM request;
- ``before``: the old per-token loop (``_TalkerRun`` of commit 459c307) replayed on the same talker
  engine: prefix and reply stream from ``build_talker_inputs``, then per code one vLLM request of one
  token over ``prompt_embeds``, appending ``project(codec_embed[code] + reply[k])``. Its codes must equal
  ``after``'s (checked). The old pooling pass (one prefill of the thinker per request) is not in
  these figures; its engine is gone, and ``before_pooling_pass_ms_estimate`` times a one-token request
  over the same ids on the thinker stage (that prefill, plus one sampled token) instead;
- ``transformers``: ``Qwen2_5OmniForConditionalGeneration.talker.generate`` with the exact arguments
  transformers' ``generate(return_audio=True)`` passes it (captured from one full call with the same
  thinker length), ``min_new_tokens == max_new_tokens == codes``, greedy.

Memory: the bytes of the thinker's text decoder weights (``thinker.model.*`` + ``thinker.lm_head.*`` in
the checkpoint's safetensors) each design holds: after once (the thinker stage), before twice (the
pooling engine held them again); and the process RSS after building the pipeline (for the record).

Run from the repository root::

    .venv/bin/python -m benchmarks.qwen2_5_omni_talker [--model DIR] [--codes 32] [--rounds 5] [--json out.json]

Without ``--model`` the tiny test checkpoint is built under ``.cache/test_assets``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.timing import interleaved_medians

REPO = Path(__file__).resolve().parent.parent


def _rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return -1


def thinker_text_bytes(model_dir: str) -> int:
    """Bytes of ``thinker.model.*`` + ``thinker.lm_head.*`` in the checkpoint's safetensors."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if key.startswith(("thinker.model.", "thinker.lm_head.")):
                    t = f.get_tensor(key)
                    total += t.numel() * t.element_size()
    return total


def _before_loop(talker, payload, codes: int):
    """The old one-request-per-codec-token loop on ``talker``'s engine; ``call() -> codes``."""
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from vllm_omni.stages.qwen2_5_omni.talker import build_talker_inputs

    tables = talker.tables
    ids = [payload.tensors[k].long() for k in ("prompt_token_ids", "output_token_ids")]
    hidden = payload.tensors["hidden_states"].float()
    voice = payload.meta.get("voice") or talker.default_voice
    bos = int(talker.speakers[voice]["bos_token"])
    stops = set(talker._default_stops())
    start = tables.ids["tts_codec_start_token_id"]
    # the old code's allowed ids while fewer than min_tokens codes (== codes here): no start, no stop
    allowed = [i for i in range(tables.codec_embed.shape[0]) if i != start and i not in stops]
    params = SamplingParams(
        temperature=0,
        max_tokens=1,
        ignore_eos=True,
        detokenize=False,
        allowed_token_ids=allowed,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    def call() -> list[int]:
        embeds, reply = build_talker_inputs(tables, *ids, hidden, bos)
        out: list[int] = []
        for k in range(codes):
            res = talker._enqueue({"prompt_embeds": embeds}, params, None).result()
            token = int(res.outputs[0].token_ids[0])
            out.append(token)
            if k + 1 < codes:
                row = reply[min(k, reply.shape[0] - 1)]
                x = tables.project((tables.codec_embed[token] + row).unsqueeze(0))
                embeds = torch.cat([embeds, x])
        return out

    return call


def _transformers_talker(model_dir: str, prompt: list[int], reply: int, codes: int, voice: str, stops):
    """``(call() -> codes, model)``: transformers' talker ``generate`` with the arguments its
    ``generate(return_audio=True)`` passes (captured once), forced to ``codes`` greedy codes."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    captured = {}
    talker_generate = model.talker.generate

    def capture(*args, **kwargs):
        captured["args"], captured["kwargs"] = args, kwargs
        return talker_generate(*args, **kwargs)

    model.talker.generate = capture
    try:
        with torch.inference_mode():
            model.generate(
                input_ids=torch.tensor([prompt]),
                speaker=voice,
                return_audio=True,
                thinker_max_new_tokens=reply,
                thinker_min_new_tokens=reply,
                thinker_do_sample=False,
                talker_max_new_tokens=codes,
                talker_min_new_tokens=codes,
                talker_do_sample=False,
                talker_repetition_penalty=1.0,
                talker_eos_token_id=list(stops),
                token2wav_num_steps=1,
            )
    finally:
        del model.talker.generate
    args, kwargs = captured["args"], captured["kwargs"]
    n_in = kwargs["input_ids"].shape[1]

    @torch.inference_mode()
    def call() -> list[int]:
        out = model.talker.generate(*args, **kwargs)
        return out[0, n_in:].tolist()

    return call, model


def run(model_dir: str, codes: int, reply: int, prompt_len: int, rounds: int) -> dict:
    """The result dict (see the module docstring)."""
    import torch
    from vllm import SamplingParams

    from vllm_omni import Omni
    from vllm_omni.inputs.stage_request import StageRequest
    from vllm_omni.stages.qwen2_5_omni.pipeline import thinker2talker

    prompt = [5 + (i % 200) for i in range(prompt_len)]
    stage = {"dtype": "float32", "max_model_len": 512}
    with Omni(model_dir, pipeline="qwen2_5_omni", stage_overrides={"0": stage, "1": stage}) as omni:
        rss = _rss_bytes()
        thinker, talker = omni._orchestrator.runtimes[:2]
        sp = SamplingParams(temperature=0, max_tokens=reply, min_tokens=reply)
        out = thinker.submit(StageRequest({"prompt_token_ids": prompt}, sp)).result()
        payload = thinker2talker(out, [None, None], None)
        voice = talker.default_voice
        payload.meta["voice"] = voice
        after_params = SamplingParams(temperature=0, max_tokens=codes, min_tokens=codes)

        def after() -> list[int]:
            res = talker.submit(StageRequest(payload, after_params)).result()
            return res.codes.tolist()

        before = _before_loop(talker, payload, codes)
        direct, _model = _transformers_talker(model_dir, prompt, reply, codes, voice, talker._default_stops())

        # the old pooling pass was one prefill of prompt + reply[:-1] on the thinker's decoder; a
        # one-token request over the same ids on the thinker stage computes that prefill (plus one
        # sampled token and the hidden-state copy): an estimate of what "before" also paid per reply
        seq = prompt + list(out.outputs[0].token_ids)[:-1]
        one = SamplingParams(temperature=0, max_tokens=1)

        def pooling_proxy() -> None:
            thinker.submit(StageRequest({"prompt_token_ids": seq}, one)).result()

        after_codes, before_codes, hf_codes = after(), before(), direct()  # warm-up, and the checks
        pooling_proxy()
        assert len(after_codes) == codes, after_codes
        assert before_codes == after_codes, (before_codes, after_codes)
        assert len(hf_codes) == codes, hf_codes
        after_s, before_s, hf_s, pool_s = interleaved_medians((after, before, direct, pooling_proxy), rounds)
        thinker_tokens = list(out.outputs[0].token_ids)

    text_bytes = thinker_text_bytes(model_dir)
    return {
        "model": model_dir,
        "prompt_tokens": prompt_len,
        "reply_tokens": len(thinker_tokens),
        "codes": codes,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "after_ms_per_code": round(1000 * after_s / codes, 3),
        "before_ms_per_code": round(1000 * before_s / codes, 3),
        "transformers_ms_per_code": round(1000 * hf_s / codes, 3),
        "after_vs_transformers": round(after_s / hf_s, 3),
        "before_vs_transformers": round(before_s / hf_s, 3),
        "after_vs_before": round(before_s / after_s, 3),  # the speed-up: before's time over after's
        "before_pooling_pass_ms_estimate": round(1000 * pool_s, 3),
        "codes_equal_before_after": True,
        "codes_equal_transformers": hf_codes == after_codes,
        "thinker_text_weight_bytes": text_bytes,
        "after_thinker_weight_bytes": text_bytes,
        "before_thinker_weight_bytes": 2 * text_bytes,
        "rss_bytes_after_build": rss,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="Qwen2.5-Omni checkpoint (default: the tiny test one)")
    parser.add_argument("--codes", type=int, default=32, help="codec tokens per request (forced)")
    parser.add_argument("--reply", type=int, default=16, help="thinker reply tokens (forced)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the result here")
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
    result = run(model, args.codes, args.reply, args.prompt, args.rounds)
    rows = [
        ("after (one request per reply)", result["after_ms_per_code"]),
        ("before (one request per code)", result["before_ms_per_code"]),
        ("transformers talker.generate", result["transformers_ms_per_code"]),
    ]
    print(f"{'design':<32} ms/code")
    for name, ms in rows:
        print(f"{name:<32} {ms}")
    print(f"{'(before: + pooling pass, per reply)':<32} ~{result['before_pooling_pass_ms_estimate']} ms")
    for key in ("after_vs_transformers", "before_vs_transformers", "after_vs_before"):
        print(f"{key:<32} {result[key]}")
    mib = 1 / 2**20
    print(
        f"thinker text weights held: after {result['after_thinker_weight_bytes'] * mib:.2f} MiB, "
        f"before {result['before_thinker_weight_bytes'] * mib:.2f} MiB; "
        f"RSS after build {result['rss_bytes_after_build'] * mib:.0f} MiB"
    )
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
