"""The compiled-stage warm-up (``DiffusionWorker.warm_up_compiled``) on Z-Image and Qwen-Image, run by default
when a compiled stage starts (``compile_warm_up=True``).

After the warm-up, no request creates a dynamo graph: adapter switches, scales, per-step and per-block
schedules, mixed adapter sets (CFG companions included), batch sizes 1-4 with and without CFG (one
denoiser row included), all scales zero. Every request's latents equal the eager stage's (fp32).

The blocks are compiled with dynamo's ``eager`` backend (dynamo's tracing, guards and graph count
without inductor's code generation, which costs up to a minute per graph here);
``test_diffusion_compile.py`` compares inductor's numbers with eager's, and
``VLLM_OMNI_TEST_COMPILE_BACKEND=inductor`` runs this module with inductor.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest, RequestAdapter
from vllm_omni.lora.schedule import LoRAScaleSchedule

TOL = 1e-4
#: dynamo backend of the compiled blocks (``VLLM_OMNI_TEST_COMPILE_BACKEND=inductor`` for the real one)
BACKEND = os.environ.get("VLLM_OMNI_TEST_COMPILE_BACKEND", "eager")
PROMPTS = ["a green teapot", "a lighthouse on a cliff at night", "red", "a cat"]


def _engines(model, cache_dir):
    def config(**kw):
        return OmniDiffusionConfig(
            model=str(model), dtype="float32", device="cpu", enable_progress_bar=False, max_loras=3, **kw
        )

    compiled = DiffusionEngine(
        config(enforce_eager=False, compile_cache_dir=str(cache_dir), compile_backend=BACKEND)
    )
    return compiled, DiffusionEngine(config(enforce_eager=True))


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _run(engine, sets, cfg=True):
    sp = OmniDiffusionSamplingParams(
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=4.0 if cfg else 0.0,
        negative_prompt="blurry",
        seed=3,
        output_type="latent",
    )
    lora_sets = [tuple(RequestAdapter(a, s) for a, s in entries) for entries in sets]
    outs = engine.worker.generate_batch(PROMPTS[: len(sets)], sp, lora_sets)
    return torch.cat([o.latents for o in outs])


def _check_warm_stage(model, loras, block_list, cache_dir):
    compiled, eager = _engines(model, cache_dir)
    try:
        a, b = (LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(loras.items()))
        warm, seconds = compiled.worker.warm_up  # by default, at start (compile_warm_up=True)
        assert warm >= 3 and seconds > 0  # one row / rows / padded rows, LoRA off and on
        assert compiled.worker.describe()["warm_up"] == (warm, seconds)
        start = _graphs()
        per_block = LoRAScaleSchedule(1.0, {f"{block_list}.0": 0.5})
        requests = [
            ([[(a, 0.8)]], True),
            ([[(a, 0.8), (b, -0.5)], [(b, 1.2)], [], [(a, 0.3)]], True),  # mixed, CFG companions
            ([[(a, LoRAScaleSchedule([0.0, 1.5]))], [(b, per_block)]], True),
            ([[(b, 1.0)]], False),  # one denoiser row
            ([[(b, 0.7)], [(a, 0.0)], [(a, 2.0), (b, 0.1)]], False),
        ]
        outs = []
        for sets, cfg in requests:
            got, want = _run(compiled, sets, cfg), _run(eager, sets, cfg)
            assert (got - want).abs().max().item() <= TOL, (sets, cfg)
            outs.append(got)
        base = _run(compiled, [[]] * 4, True)
        assert (outs[1][0] - base[0]).abs().max().item() > 50 * TOL  # the adapters did change the image
        assert torch.equal(outs[1][2], base[2])  # the adapter-free prompt of the mixed batch is the base
        assert _graphs() == start, "a request after the warm-up compiled a new graph"
        assert sum(c.stats.graphs for c in compiled.worker.compilers) == warm
    finally:
        compiled.shutdown()
        eager.shutdown()


@pytest.mark.slow
def test_warmed_z_image_never_recompiles(tiny_z_image_dir, tiny_z_image_loras, tmp_path):
    loras = {name: tiny_z_image_loras[name] for name in ("attn", "ff")}
    _check_warm_stage(tiny_z_image_dir, loras, "layers", tmp_path)


@pytest.mark.slow
def test_warmed_qwen_image_never_recompiles(tiny_qwen_image_dir, tiny_qwen_image_loras, tmp_path):
    loras = {name: tiny_qwen_image_loras[name] for name in ("attn", "mlp")}
    _check_warm_stage(tiny_qwen_image_dir, loras, "transformer_blocks", tmp_path)
