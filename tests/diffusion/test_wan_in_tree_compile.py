"""Compiled in-tree Wan stage (``enforce_eager=False``: regional compilation of the experts' blocks, LoRA
read from fixed-shape banks) against the eager stage on the tiny Wan2.2-style two-expert weights
(``tools/make_tiny_wan.py --moe``), float32: the final latents agree within 1e-4 with the ``[high, low]``
pair and after a switch of adapters and scales (the low-noise file on the high-noise expert and the
reverse, at scales 0.5 and -1.5), and the switch compiles no new graph. Both experts share the block class,
so they share its graph; an adapter on each expert in every run keeps the test to that one graph (the
LoRA-off graph: Z-Image's ``test_diffusion_compile`` and the benchmark below).

The blocks are compiled with torch's ``aot_eager`` backend (dynamo's graph capture, guards and AOT
autograd's functionalisation, eager kernels): what decides recompiles and the banked LoRA path is the
same as under inductor, at a few seconds of CPU instead of ~40 s of C++ kernel builds. Inductor's kernels
on this model: ``python -m benchmarks.wan_in_tree --compile-check`` (max difference 2.7e-6); inductor
under LoRA in the suite: Z-Image's ``test_diffusion_compile``.
"""

from __future__ import annotations

import pytest
import torch

from tests.diffusion.test_wan_moe_distill import GEN, NUM_FRAMES, PROMPT, SEED
from vllm_omni.lora.request import LoRARequest

pytestmark = [pytest.mark.slow]
TOL = 1e-4


def _sp():
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return OmniDiffusionSamplingParams(
        seed=SEED, output_type="latent", extra_args={"num_frames": NUM_FRAMES}, **GEN
    )


def _graphs(omni) -> int:
    worker = omni._orchestrator.runtimes[0]._engine.worker
    return sum(c.stats.graphs for c in worker.compilers)


def test_compiled_equals_eager_and_an_adapter_switch_does_not_recompile(tmp_path, monkeypatch):
    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan, ensure_tiny_wan_loras
    from vllm_omni import Omni

    root = test_assets_root()
    model_dir = ensure_tiny_wan(root, moe=True)
    files = ensure_tiny_wan_loras(root)
    high, low = LoRARequest("high", 1, str(files["high"])), LoRARequest("low", 2, str(files["low"]))
    warm_up = {"pair": {"lora_requests": [high, low]}}
    # an adapter on each expert in every run: one graph (LoRA on) is all the test compiles; the switch
    # swaps the files between the experts and changes both scales
    low_first = LoRARequest("low_first", 3, str(files["low"]))
    switches = {"swapped": {"lora_requests": [low_first, high], "lora_scales": [0.5, -1.5]}}
    latents: dict[bool, dict[str, torch.Tensor]] = {}
    for eager in (True, False):
        kwargs = (
            {}
            if eager
            else {
                "compile_cache_dir": str(tmp_path / "compile_cache"),
                "compile_backend": "aot_eager",
                "compile_warm_up": False,  # this test's own warm-up: one graph (LoRA on)
            }
        )
        with Omni(
            str(model_dir),
            max_loras=2,
            dtype="float32",
            enforce_eager=eager,
            enable_progress_bar=False,
            **kwargs,
        ) as omni:
            runs = {
                name: omni.generate([PROMPT], _sp(), use_tqdm=False, **kw)[0].latents
                for name, kw in warm_up.items()
            }
            warm = _graphs(omni)
            runs |= {
                name: omni.generate([PROMPT], _sp(), use_tqdm=False, **kw)[0].latents
                for name, kw in switches.items()
            }
            assert _graphs(omni) == warm and (warm == 0) == eager, (
                f"graphs: {warm} after warm-up, {_graphs(omni)} after"
            )
        latents[eager] = runs
    assert (latents[True]["pair"] - latents[True]["swapped"]).abs().max() > 0.02  # the adapters matter
    for name in latents[True]:
        err = (latents[True][name] - latents[False][name]).abs().max().item()
        assert err <= TOL, f"{name}: compiled differs from eager by {err}"
