"""Hostile / careless input on a diffusion stage: clear errors naming the field or adapter, no
silent NaN images, no process-killing allocations, and a bad request never poisons its batch."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_omni.errors import LoRAFormatError
from vllm_omni.inputs.data import MAX_IMAGES_PER_PROMPT, MAX_SEQUENCE_LENGTH, OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest, RequestAdapters

SMALL = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.0, output_type="latent")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"guidance_scale": float("nan")}, "guidance_scale must be >= 0 and finite"),
        ({"guidance_scale": float("inf")}, "guidance_scale must be >= 0 and finite"),
        ({"guidance_scale": "big"}, "guidance_scale must be >= 0 and finite"),
        ({"num_images_per_prompt": True}, "num_images_per_prompt must be an integer"),
        ({"num_images_per_prompt": MAX_IMAGES_PER_PROMPT + 1}, "num_images_per_prompt must be an integer"),
        ({"max_sequence_length": MAX_SEQUENCE_LENGTH + 1}, "max_sequence_length must be an integer"),
        ({"max_sequence_length": "x"}, "max_sequence_length must be an integer"),
        ({"num_inference_steps": True}, "num_inference_steps must be an integer"),
        ({"height": True}, "height must be a positive integer"),
        ({"seed": "abc"}, "seed must be an integer"),
        ({"seed": 2**70}, "seed must be an integer"),
        ({"negative_prompt": 5}, "negative_prompt must be a string or a list of strings"),
        ({"extra_args": "x"}, "extra_args must be a dict"),
    ],
)
def test_sampling_params_refuse_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OmniDiffusionSamplingParams(**{**SMALL, **kwargs})


@pytest.fixture(scope="module")
def omni(tiny_z_image_dir):
    from vllm_omni import Omni

    engine = Omni(
        model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False, max_loras=2, seed=0
    )
    yield engine
    engine.shutdown()


def _nan_copy(src, dst):
    if src.is_dir():
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".complete", ".lock"))
        files = sorted(dst.glob("*.safetensors"))
    else:
        shutil.copy(src, dst)
        files = [dst]
    for f in files:
        tensors = load_file(f)
        save_file({k: v * float("nan") for k, v in tensors.items()}, f, metadata=None)
    return dst


def test_non_finite_adapter_weights_are_refused_and_the_batch_is_not_poisoned(
    omni, tiny_z_image_loras, tmp_path
):
    nan_dir = _nan_copy(tiny_z_image_loras["qv"], tmp_path / "nan_qv")
    bad = LoRARequest("nan", 90, str(nan_dir))
    with pytest.raises(LoRAFormatError, match="holds NaN or inf weights"):
        omni.add_lora(bad)
    assert 90 not in omni.list_loras()
    good = LoRARequest("qv", 91, str(tiny_z_image_loras["qv"]))
    params = OmniDiffusionSamplingParams(**SMALL, seed=3)
    alone = omni.generate("a dog", params, lora_request=good)[0].latents
    futures = []
    with omni._orchestrator.batching():
        for lora in (good, bad, None):
            futures.append(omni._orchestrator.submit("a dog", [params], {0: RequestAdapters.of(lora)}))
    with pytest.raises(LoRAFormatError, match="nan"):
        futures[1].result(timeout=300)
    latents = futures[0].result(timeout=300)[0].latents
    assert torch.isfinite(latents).all() and torch.isfinite(futures[2].result(timeout=300)[0].latents).all()
    torch.testing.assert_close(latents, alone, rtol=1e-4, atol=1e-4)
    assert 90 not in omni.list_loras()


def test_non_finite_single_file_adapter_is_refused(omni, tiny_z_image_loras, tmp_path):
    nan_file = _nan_copy(tiny_z_image_loras["attn_file"], tmp_path / "nan_attn.safetensors")
    with pytest.raises(LoRAFormatError, match="holds NaN or inf weights"):
        omni.add_lora(LoRARequest("nan_file", 92, str(nan_file)))
