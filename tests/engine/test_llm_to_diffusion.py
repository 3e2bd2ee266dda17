"""llm_to_diffusion on real engines: a tiny Qwen2 vLLM stage 0 whose text prompts a tiny Z-Image stage 1.

Also checks that the in-process vLLM engine and the in-process diffusion runtime coexist (they
share vLLM's global distributed state) in both start-up orders, and that shutting one down
leaves the other working.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams

from tests.llm_reference import hf_greedy
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest

pytestmark = pytest.mark.engine

N = 8
DIFF = dict(height=32, width=32, num_inference_steps=2, guidance_scale=2.0, seed=4)


@pytest.fixture(scope="module")
def z_image_dir():
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return ensure_tiny_diffusion_assets(test_assets_root())["z_image"]


def _deploy(tmp_path, llm_dir, z_dir):
    path = tmp_path / "llm_to_diffusion.yaml"
    path.write_text(
        "pipeline: llm_to_diffusion\n"
        "stages:\n"
        f"  - stage_id: 0\n    model: {llm_dir}\n    enable_lora: true\n    max_lora_rank: 16\n    max_cpu_loras: 2\n"
        "    engine_extras: {max_model_len: 256, dtype: float32}\n"
        f"  - stage_id: 1\n    model: {z_dir}\n    dtype: float32\n    enable_progress_bar: false\n"
    )
    return str(path)


def test_llm_text_prompts_diffusion_stage_with_stage_scoped_lora(tiny_llm_assets, z_image_dir, tmp_path):
    from vllm_omni import Omni

    # a diffusion runtime that exists before the LLM engine starts, and must survive its shutdown
    solo = Omni(model=str(z_image_dir), dtype="float32", enable_progress_bar=False)
    before = solo.generate("a tiny robot", OmniDiffusionSamplingParams(**DIFF))[0]

    llm_dir = str(tiny_llm_assets.model_dir)
    adapter = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    llm_params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    with Omni(deploy_config=_deploy(tmp_path, llm_dir, z_image_dir), max_cpu_loras=3) as omni:
        llm_stage, diffusion_stage = omni.stage_configs
        assert llm_stage.lora_config is not None and llm_stage.lora_config.max_cpu_loras == 2
        diffusion_runtime = omni._orchestrator.runtimes[1]
        assert diffusion_runtime.od_config.max_cpu_loras == 3  # the global value sized the diffusion cache
        (out,) = omni.generate(
            "hello world", [llm_params, OmniDiffusionSamplingParams(**DIFF)], lora_request=adapter
        )
        text = out.stage_outputs[0].outputs[0].text
        assert list(out.stage_outputs[0].outputs[0].token_ids) == hf_greedy(
            llm_dir, "hello world", N, tiny_llm_assets.adapter_a
        )
        assert out.stage_id == 1 and out.final_output_type == "image"
        assert out.prompt == text and out.images[0].size == (32, 32)
        # stage 1 ran on stage 0's text, without the request's adapter
        direct = diffusion_runtime.submit(StageRequest(text, OmniDiffusionSamplingParams(**DIFF))).result()
        assert torch.equal(out.latents, direct.latents)
        assert omni.list_loras(stage_id=1) == set() and omni.list_loras(stage_id=0) == {1}
        # stage-scoped runtime management: the LLM adapter goes to stage 0 only
        assert omni.add_lora(LoRARequest("b", 2, str(tiny_llm_assets.adapter_b)), stage_id=0)
        assert omni.list_loras() == {1, 2}
        _later_stage_adapter_is_versioned(omni, llm_params, z_image_dir, tmp_path)
    after = solo.generate("a tiny robot", OmniDiffusionSamplingParams(**DIFF))[0]
    solo.shutdown()
    assert torch.equal(before.latents, after.latents)


def _later_stage_adapter_is_versioned(omni, llm_params, z_image_dir, tmp_path):
    """An adapter in a later diffusion stage's params (``lora_requests`` of stage 1's
    ``OmniDiffusionSamplingParams``) is versioned like an entry-stage one (issue 21 rule 1): after its
    files are rewritten in place, stage 1 serves the new weights, never the host cache's entry of the
    old ones. Latents are compared with diffusers+peft on the files on disk."""
    from tests.conftest import test_assets_root
    from tests.diffusion.lora_oracle import reference_latents, reference_pipeline
    from tools.make_tiny_diffusion_lora import ensure_tiny_z_image_loras

    loras = ensure_tiny_z_image_loras(z_image_dir, test_assets_root())
    path = tmp_path / "later"
    shutil.copytree(loras["attn"], path)
    later = LoRARequest("later", 7, str(path))
    params = OmniDiffusionSamplingParams(**DIFF, output_type="latent", lora_requests=[later])
    kw = dict(
        seed=DIFF["seed"],
        steps=DIFF["num_inference_steps"],
        guidance=DIFF["guidance_scale"],
        height=32,
        width=32,
    )

    def run():
        (out,) = omni.generate("hello world", [llm_params, params])
        return out.prompt, out.latents

    prompt, first = run()
    ref = {
        n: reference_latents(reference_pipeline(z_image_dir, [(loras[n], 1.0)]), prompt, **kw)
        for n in ("attn", "ff")
    }
    assert (ref["attn"] - ref["ff"]).abs().max() > 5e-3
    assert (first - ref["attn"]).abs().max() <= 1e-4
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(Path(loras["ff"]) / name, path / name)
    assert (run()[1] - ref["ff"]).abs().max() <= 1e-4


@pytest.mark.slow
def test_llm_first_then_diffusion_in_a_fresh_process(tiny_llm_assets, z_image_dir, tmp_path):
    """vLLM engine starts first (owns the distributed state); diffusion joins; each survives the other."""
    deploy = _deploy(tmp_path, tiny_llm_assets.model_dir, z_image_dir)
    script = textwrap.dedent(
        f"""
        import os
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        import torch
        from vllm import SamplingParams
        from vllm_omni import Omni
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams as P

        if __name__ == "__main__":
            sp = P(**{DIFF!r})
            with Omni(deploy_config={deploy!r}) as omni:
                (out,) = omni.generate("hello", [SamplingParams(temperature=0.0, max_tokens=4), sp])
                text = out.prompt
            with Omni(model={str(z_image_dir)!r}, dtype="float32", enable_progress_bar=False) as solo:
                again = solo.generate(text, sp)[0]
            assert torch.equal(out.latents, again.latents), "diffusion differs after the LLM engine shut down"
            print("OK")
        """
    )
    path = tmp_path / "llm_first.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
