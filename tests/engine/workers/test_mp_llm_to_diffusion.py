"""``worker_backend="mp"`` on ``llm_to_diffusion``: parity with the inline backend.

Stage 0 (tiny Qwen2, adapter on the request) writes the prompt of stage 1 (tiny Z-Image, a
run-time adapter added to it); latents (tensors through shared memory) and images must equal
the inline backend's bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm import SamplingParams

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


def _run(backend: str, deploy: str, llm_adapter: LoRARequest, diffusion_adapter: LoRARequest):
    from vllm_omni import Omni

    with Omni(deploy_config=deploy, worker_backend=backend) as omni:
        assert omni.add_lora(diffusion_adapter, stage_id=1)
        outs = omni.generate(
            ["hello world", "a red cube"],
            [LLM, OmniDiffusionSamplingParams(**DIFF)],
            lora_request=llm_adapter,
            use_tqdm=False,
        )
        return outs, omni.list_loras(stage_id=0), omni.list_loras(stage_id=1)


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
    llm_adapter = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    diffusion_adapter = LoRARequest("qv", 7, str(test_assets_root() / "tiny-z-image-loras" / "qv"))
    inline, *inline_loras = _run("inline", str(deploy), llm_adapter, diffusion_adapter)
    mp, *mp_loras = _run("mp", str(deploy), llm_adapter, diffusion_adapter)
    assert mp_loras == inline_loras == [{1}, {7}]
    assert len(mp) == len(inline) == 2
    for a, b in zip(mp, inline):
        assert a.prompt == b.prompt  # stage 0's text
        assert list(a.stage_outputs[0].outputs[0].token_ids) == list(b.stage_outputs[0].outputs[0].token_ids)
        assert torch.equal(a.latents, b.latents)
        assert np.array_equal(np.asarray(a.images[0]), np.asarray(b.images[0]))
