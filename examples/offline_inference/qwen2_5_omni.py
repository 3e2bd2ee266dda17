"""Qwen2.5-Omni through ``Omni``: text and speech from one prompt (thinker -> talker -> code2wav).

With no ``--model`` the tiny random test checkpoint is built (seconds) under ``--assets`` and
used: its text is gibberish and its "speech" noise, but every stage runs. With the real model::

    python examples/offline_inference/qwen2_5_omni.py
    python examples/offline_inference/qwen2_5_omni.py --model Qwen/Qwen2.5-Omni-7B --dtype bfloat16 \\
        --voice Ethan --out reply.wav

``--thinker-adapter`` / ``--talker-adapter`` give each LLM stage its own PEFT adapter for this
request (``lora_request={0: ..., 1: ...}``); both stages then start with ``enable_lora``.
The WAV is 16-bit mono at the code2wav stage's sample rate.
"""

from __future__ import annotations

import argparse
import os
import wave
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="Qwen2.5-Omni directory or hub id (default: tiny test model)"
    )
    p.add_argument("--prompt", default="Tell me a short story.")
    p.add_argument(
        "--voice", default=None, help="a speaker of the checkpoint's spk_dict.pt (default: the first)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="thinker tokens")
    p.add_argument("--talker-max-tokens", type=int, default=64, help="codec tokens")
    p.add_argument("--dit-steps", type=int, default=4, help="code2wav flow-matching steps (transformers: 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--thinker-adapter", default=None)
    p.add_argument("--talker-adapter", default=None)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="qwen2_5_omni.wav")
    p.add_argument(
        "--assets",
        default=os.environ.get("VLLM_OMNI_TEST_ASSETS") or str(REPO / ".cache" / "test_assets"),
        help="where the tiny model is built when --model is not given",
    )
    return p.parse_args(argv)


def write_wav(path: str, waveform: np.ndarray, sample_rate: int) -> None:
    """``waveform`` (float32 samples in [-1, 1]) as a 16-bit mono WAV."""
    pcm = (np.clip(waveform, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import vllm_omni  # noqa: F401 - before vLLM: its known start-up noise is said once (vllm_omni/log_noise.py)

    # isort: split

    from vllm import SamplingParams

    from vllm_omni import Omni
    from vllm_omni.inputs.audio import AudioParams
    from vllm_omni.lora.request import LoRARequest

    model = args.model
    if model is None:
        import sys

        sys.path.insert(0, str(REPO))
        from tools.make_tiny_qwen2_5_omni import ensure_tiny_omni_assets

        model = str(ensure_tiny_omni_assets(args.assets).model_dir)
    adapters = {
        stage: LoRARequest(name, stage + 1, path)
        for stage, name, path in ((0, "thinker", args.thinker_adapter), (1, "talker", args.talker_adapter))
        if path
    }
    stage = {"dtype": args.dtype, "max_model_len": args.max_model_len}
    if adapters:
        stage |= {"enable_lora": True, "max_lora_rank": 64}
    params = [
        SamplingParams(temperature=0, max_tokens=args.max_tokens),
        SamplingParams(temperature=0, max_tokens=args.talker_max_tokens),
        AudioParams(voice=args.voice, seed=args.seed, num_steps=args.dit_steps),
    ]
    with Omni(model, pipeline="qwen2_5_omni", stage_overrides={"0": stage, "1": stage}) as omni:
        tok = omni.entry_stage_info.tokenizer
        from transformers import AutoTokenizer

        messages = [{"role": "user", "content": args.prompt}]
        ids = AutoTokenizer.from_pretrained(tok).apply_chat_template(messages, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        text, audio = omni.generate({"prompt_token_ids": list(ids)}, params, lora_request=adapters or None)
    write_wav(args.out, audio.audio, audio.sample_rate)
    seconds = audio.audio.shape[0] / audio.sample_rate
    print(f"text: {text.text!r}")
    print(
        f"audio: {args.out} ({seconds:.2f} s at {audio.sample_rate} Hz, {len(audio.stage_outputs[1].codes)} codes)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
