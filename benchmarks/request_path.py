"""Per-request cost of the request-adapter path: the typed one (one converter, one check against the stage's
description, a ``StageRequest``) against the previous one (converter to keyword arguments, the HTTP route's
and the diffusion stage's own re-validation), measured in one run.

Only the part that changed is timed, without engines: the previous path's converter is loaded from the
commit before the change (``git show <rev>:vllm_omni/entrypoints/request_adapters.py``, run against this
checkout's shared helpers), the stages' descriptions are built by hand. Both sides turn the same request
(a diffusion entry stage with two composed adapters, one with a per-step schedule; or an LLM entry stage
with one adapter) into what the stage runtime receives; the sides take turns within each repeat, and the
CPU time of this process is the clock, so the machine's load hits both alike.

Run from the repository root::

    .venv/bin/python -m benchmarks.request_path [--rev fda9cba~1] [--repeats 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _previous_converter(rev: str) -> types.ModuleType:
    """The previous ``request_adapters`` module, loaded from git (it uses helpers this checkout still has)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:vllm_omni/entrypoints/request_adapters.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType("previous_request_adapters")
    exec(compile(source, "previous_request_adapters.py", "exec"), module.__dict__)
    return module


def _one_stage_config(label: str, is_llm: bool) -> types.SimpleNamespace:
    """What both converters read of a one-stage ``VllmOmniConfig`` (no model directory needed)."""
    stage = types.SimpleNamespace(stage_id=0, label=label, is_llm=is_llm)
    return types.SimpleNamespace(
        stages=[stage], entry_stage=stage, pipeline=types.SimpleNamespace(name="one_stage")
    )


def _cases():
    from vllm import SamplingParams

    from vllm_omni.engine.protocols import AdapterCapabilities, StageDescription
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.lora.request import LoRARequest, RequestAdapter

    a, b = LoRARequest("a", 1, "/tmp/a"), LoRARequest("b", 2, "/tmp/b")
    dparams = OmniDiffusionSamplingParams(num_inference_steps=4, height=64, width=64)
    diffusion = _one_stage_config("Stage 0 (diffusion)", is_llm=False)
    ddesc = StageDescription(
        0,
        "Stage 0 (diffusion)",
        "image",
        frozenset({"text"}),
        OmniDiffusionSamplingParams,
        adapters=AdapterCapabilities("diffusion", 4, 4, 64, denoisers=("transformer",)),
    )
    llm = _one_stage_config("Stage 0 (llm)", is_llm=True)
    ldesc = StageDescription(
        0,
        "Stage 0 (llm)",
        "text",
        frozenset({"text"}),
        SamplingParams,
        adapters=AdapterCapabilities("llm", 4, 1, 16),
    )
    composed = (RequestAdapter(a, 0.5), RequestAdapter(b, [1.0, 0.8, 0.6, 0.4]))
    return {
        "diffusion_two_adapters": (diffusion, [ddesc], [dparams], composed),
        "llm_one_adapter": (llm, [ldesc], [SamplingParams(max_tokens=8)], (RequestAdapter(a),)),
    }


def _sides(previous: types.ModuleType, config, descriptions, params, adapters):
    from vllm_omni.entrypoints.request_adapters import request_adapters, without_params_loras
    from vllm_omni.inputs.stage_request import StageRequest
    from vllm_omni.lora.request import llm_stage_adapter, validate_request_adapters

    caps = descriptions[0].adapters
    steps = getattr(params[0], "num_inference_steps", None)

    def before():
        # the HTTP route's two checks, the converter, then the stage's own check (diffusion)
        if caps.kind == "llm":
            llm_stage_adapter(adapters, "stage")
        validate_request_adapters(adapters, caps.max_per_request, field="lora", num_steps=steps)
        validate_request_adapters(adapters, field="lora", num_steps=steps)
        [(kw, _later)] = previous.request_loras(config, 1, params[0], adapters=adapters)
        if "adapters" in kw:
            validate_request_adapters(kw["adapters"], caps.max_per_request, num_steps=steps)

    def after():
        [per_stage] = request_adapters(config, descriptions, 1, params, adapters=adapters, field="lora")
        StageRequest("a prompt", without_params_loras(params[0]), per_stage[0])

    return {"before": before, "after": after}


def measure(rev: str, repeats: int, calls: int) -> dict:
    previous = _previous_converter(rev)
    out = {}
    for name, case in _cases().items():
        sides = _sides(previous, *case)
        times: dict[str, list[float]] = {s: [] for s in sides}
        for fn in sides.values():  # warm-up
            fn()
        for _ in range(repeats):
            for side, fn in sides.items():
                t0 = time.process_time()
                for _ in range(calls):
                    fn()
                times[side].append((time.process_time() - t0) / calls * 1e6)
        med = {s: statistics.median(v) for s, v in times.items()}
        out[name] = {
            "before_us": round(med["before"], 2),
            "after_us": round(med["after"], 2),
            "ratio_after_over_before": round(med["after"] / med["before"], 3),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="fda9cba~1", help="the commit whose request path is 'before'")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="requests per timed repeat")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = {
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rev_before": args.rev,
        "clock": "process CPU time per request (us), median over repeats",
        "cases": measure(args.rev, args.repeats, args.calls),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
