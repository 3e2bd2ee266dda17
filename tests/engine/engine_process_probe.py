"""Runs one engine in a fresh process for the tests that must not share pytest's process.

``python tests/engine/engine_process_probe.py MODE ASSETS_DIR`` prints one line
``@@probe {"outputs": {...}, ...}`` and exits 0; a crash (SIGILL) shows in the exit status.

Modes:
    ``raw-mixed``: raw ``vllm.LLM`` (float32, max_loras=2), one alternating adapter / no-adapter
        batch; ``outputs`` maps ``"unpatched"`` (vLLM's own LoRA ops) and ``"patched"`` (after
        :func:`vllm_omni.platform.patch_torch_lora_ops`) to the token ids of each request.
    ``short-prompts``: ``Omni(model, enable_lora=True, max_lora_rank=16)`` in the DEFAULT dtype,
        1-, 2- and 4-token prompts with and without an adapter.
    ``short-prompts-no-amx``: the same with :func:`vllm_omni.platform.request_amx_permission`
        disabled (the control run: on AMX CPUs it must die with SIGILL).
    ``compile-cache``: ``Omni(model, dtype="float32")`` (vLLM compiles the model), one greedy
        request; ``outputs`` holds its token ids, ``counters`` inductor's FX graph cache hits and
        misses (``torch._dynamo.utils.counters``) and ``aot_env`` ``$VLLM_USE_AOT_COMPILE``.
    ``raw-targets``: for each ``lora_target_modules`` list in the JSON list ``$PROBE_TARGETS``, a raw
        ``vllm.LLM`` (float32) and one greedy request with ``adapter_a``; ``by_targets`` maps the
        ``+``-joined list to ``{"outputs": token ids}`` or ``{"error": what vLLM raised}``.

vLLM's general plugins are disabled with ``VLLM_PLUGINS`` set by the caller where the run
must not get vllm_omni's plugin (an installed checkout registers it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: name of the adapter per request of the mixed batch (None: no adapter); with max_loras=2
#: both adapters are resident, so vLLM's "-1" wraps onto a slot that holds one
MIXED_NAMES = ["a", None, "b", None, "a", None, "b", None]
MIXED_PROMPTS = ["hello world", "the quick brown fox", "a b c"]
N_TOKENS = 10
#: the short prompts of issue 13 item 1, as token ids (1, 2 and 4 tokens)
SHORT_PROMPTS = [[72], [72, 105], [72, 105, 32, 116]]
_TAG = "@@probe "  # prefix of the result line (vLLM's processes print to stdout too)


def mixed_prompt(i: int) -> str:
    return MIXED_PROMPTS[i % len(MIXED_PROMPTS)]


def _raw_mixed(assets: Path) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from vllm_omni.platform import patch_torch_lora_ops, torch_lora_ops_patched

    llm = LLM(
        str(assets / "model"),
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
    )
    adapters = {n: LoRARequest(n, i + 1, str(assets / f"adapter_{n}")) for i, n in enumerate("ab")}
    loras = [adapters.get(n) for n in MIXED_NAMES]
    prompts = [mixed_prompt(i) for i in range(len(MIXED_NAMES))]
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    out = {}
    was_patched = torch_lora_ops_patched()
    for label in ("unpatched", "patched"):
        if label == "patched":
            patch_torch_lora_ops()
        results = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        out[label] = [list(r.outputs[0].token_ids) for r in results]
    return {"patched_at_start": was_patched, "outputs": out}


def _short_prompts(assets: Path, with_permission: bool) -> dict:
    import vllm_omni.platform as platform

    if not with_permission:
        platform.request_amx_permission = lambda: False
    from vllm import SamplingParams

    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    adapter = LoRARequest("a", 1, str(assets / "adapter_a"))
    out = {}
    with Omni(str(assets / "model"), enable_lora=True, max_lora_rank=16, max_model_len=256) as omni:
        for ids in SHORT_PROMPTS:
            for lora in (None, adapter):
                res = omni.generate(
                    {"prompt_token_ids": ids}, SamplingParams(max_tokens=4), lora_request=lora
                )
                out[f"{len(ids)}-{'a' if lora else 'base'}"] = list(res[0].token_ids)
    return {"outputs": out}


def _compile_cache(assets: Path) -> dict:
    from torch._dynamo.utils import counters
    from vllm import SamplingParams

    from vllm_omni import Omni

    with Omni(str(assets / "model"), dtype="float32", max_model_len=256, max_num_seqs=4) as omni:
        res = omni.generate(
            MIXED_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
        )
    return {
        "outputs": list(res[0].token_ids),
        "counters": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
        "aot_env": os.environ.get("VLLM_USE_AOT_COMPILE"),
    }


def _raw_targets(assets: Path) -> dict:
    """One raw ``vllm.LLM`` per entry of ``$PROBE_TARGETS`` (a JSON list of target lists), one after
    the other in this process (one vLLM import for all of them)."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    results = {}
    for targets in json.loads(os.environ["PROBE_TARGETS"]):
        llm = LLM(
            str(assets / "model"),
            enable_lora=True,
            max_lora_rank=16,
            lora_target_modules=targets,
            dtype="float32",
            max_model_len=256,
            max_num_seqs=8,
        )
        params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
        key = "+".join(targets)
        try:
            result = llm.generate(
                MIXED_PROMPTS[0],
                params,
                lora_request=LoRARequest("a", 1, str(assets / "adapter_a")),
                use_tqdm=False,
            )
            results[key] = {"outputs": list(result[0].outputs[0].token_ids)}
        except Exception as exc:  # vLLM refusing the adapter is one of the answers
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"by_targets": results}


def run_probe(
    mode: str, assets_dir: Path, timeout: int = 1800, unset: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess:
    """Run ``engine_process_probe.py MODE`` in a fresh interpreter with this checkout first on the
    path, this process's environment plus ``env``, without the variables named in ``unset``."""
    full_env = {k: v for k, v in os.environ.items() if k not in unset} | env
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), *([env["PYTHONPATH"]] if "PYTHONPATH" in env else [])]
    )
    return subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), mode, str(assets_dir)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def probe_result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"probe exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_TAG)]
    assert lines, f"probe printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return json.loads(lines[-1][len(_TAG) :])


def main(argv: list[str]) -> int:
    mode, assets = argv[0], Path(argv[1])
    if mode == "raw-mixed":
        result = _raw_mixed(assets)
    elif mode == "raw-targets":
        result = _raw_targets(assets)
    elif mode == "compile-cache":
        result = _compile_cache(assets)
    elif mode in ("short-prompts", "short-prompts-no-amx"):
        result = _short_prompts(assets, with_permission=mode == "short-prompts")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
