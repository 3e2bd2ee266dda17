"""``worker_backend="mp"`` on ``llm_to_diffusion``: parity with the inline backend.

Stage 0 (tiny Qwen2, adapter on the request) writes the prompt of stage 1 (tiny Z-Image, a
run-time adapter added to it); stage 0's tokens must equal the inline backend's exactly, the
latents (tensors through shared memory) to float32 rounding and the images to one level.
The diffusion stage is not bit-exact across the two backends: inline, it shares its process
with the LLM engine, which lowers torch's intra-op thread count to 1 for the whole process,
while its own worker keeps torch's default; a different thread count changes the order of
float reductions.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from tests.llm_reference import hf_greedy
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

DIFF = dict(height=32, width=32, num_inference_steps=2, guidance_scale=2.0, seed=4)
LLM = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def z_image_dir():
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return ensure_tiny_diffusion_assets(test_assets_root())["z_image"]


def _run(
    backend: str, deploy: str, llm_adapter: LoRARequest, diffusion_adapter: LoRARequest, new_files: Path
):
    """Outputs of two prompts, the adapters loaded per stage, and stage 0's tokens for "hello world"
    after ``llm_adapter``'s folder was rewritten with ``new_files``' adapter (issue 21 rule 1: the
    next request gets what is on disk)."""
    from vllm_omni import Omni

    with Omni(deploy_config=deploy, worker_backend=backend) as omni:
        assert omni.add_lora(diffusion_adapter, stage_id=1)
        outs = omni.generate(
            ["hello world", "a red cube"],
            [LLM, OmniDiffusionSamplingParams(**DIFF)],
            lora_request=llm_adapter,
            use_tqdm=False,
        )
        loaded = [omni.list_loras(stage_id=0), omni.list_loras(stage_id=1)]
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(new_files / name, Path(llm_adapter.lora_path) / name)
        (again,) = omni.generate(
            ["hello world"],
            [LLM, OmniDiffusionSamplingParams(**DIFF)],
            lora_request=llm_adapter,
            use_tqdm=False,
        )
        return outs, loaded, list(again.stage_outputs[0].outputs[0].token_ids)


def test_mp_equals_inline_with_adapters(tiny_llm_assets, z_image_dir, tmp_path):
    from tests.conftest import test_assets_root

    deploy = tmp_path / "l2d.yaml"
    deploy.write_text(
        "pipeline: llm_to_diffusion\n"
        "stages:\n"
        f"  - stage_id: 0\n    model: {tiny_llm_assets.model_dir}\n    enable_lora: true\n"
        "    max_lora_rank: 16\n    engine_extras: {max_model_len: 256, dtype: float32}\n"
        f"  - stage_id: 1\n    model: {z_image_dir}\n    dtype: float32\n    enable_progress_bar: false\n"
    )
    diffusion_adapter = LoRARequest("qv", 7, str(test_assets_root() / "tiny-z-image-loras" / "qv"))
    runs = {}
    for backend in ("inline", "mp"):
        folder = tmp_path / backend  # the adapter's folder, rewritten in the run
        shutil.copytree(tiny_llm_assets.adapter_a, folder)
        llm_adapter = LoRARequest("a", 1, str(folder))
        runs[backend] = _run(backend, str(deploy), llm_adapter, diffusion_adapter, tiny_llm_assets.adapter_b)
    (inline, inline_loras, inline_new), (mp, mp_loras, mp_new) = runs["inline"], runs["mp"]
    assert mp_loras == inline_loras == [{1}, {7}]
    ref_a = hf_greedy(tiny_llm_assets.model_dir, "hello world", 8, tiny_llm_assets.adapter_a)
    ref_b = hf_greedy(tiny_llm_assets.model_dir, "hello world", 8, tiny_llm_assets.adapter_b)
    assert ref_a != ref_b and mp_new == inline_new == ref_b
    assert list(mp[0].stage_outputs[0].outputs[0].token_ids) == ref_a
    assert len(mp) == len(inline) == 2
    for a, b in zip(mp, inline):
        assert a.prompt == b.prompt  # stage 0's text
        assert list(a.stage_outputs[0].outputs[0].token_ids) == list(b.stage_outputs[0].outputs[0].token_ids)
        torch.testing.assert_close(a.latents, b.latents, rtol=1e-5, atol=1e-5)
        pixels = np.asarray(a.images[0]).astype(int) - np.asarray(b.images[0]).astype(int)
        assert np.abs(pixels).max() <= 1
