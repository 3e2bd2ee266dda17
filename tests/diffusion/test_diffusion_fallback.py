"""Generic diffusers fallback: results equal running diffusers directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.pipelines.diffusers_fallback import DiffusersFallbackPipeline
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@pytest.fixture(scope="module")
def sd3_engine(tiny_sd3_dir):
    engine = DiffusionEngine(
        OmniDiffusionConfig(model=str(tiny_sd3_dir), dtype="float32", enable_progress_bar=False)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sd3_reference(tiny_sd3_dir):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(tiny_sd3_dir), text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_auto_backend_picks_fallback_for_sd3(sd3_engine):
    assert isinstance(sd3_engine.pipeline, DiffusersFallbackPipeline)
    assert type(sd3_engine.pipeline.pipe).__name__ == "StableDiffusion3Pipeline"
    assert type(sd3_engine.pipeline.transformer).__name__ == "SD3Transformer2DModel"


@pytest.mark.parametrize("output_type", ["np", "latent"])
def test_sd3_matches_diffusers(sd3_engine, sd3_reference, output_type):
    sp = OmniDiffusionSamplingParams(
        height=32,
        width=32,
        num_inference_steps=3,
        guidance_scale=4.0,
        negative_prompt="ugly",
        seed=9,
        output_type=output_type,
    )
    [out] = sd3_engine.generate(["a small house"], sp)
    expected = sd3_reference(
        "a small house",
        height=32,
        width=32,
        num_inference_steps=3,
        guidance_scale=4.0,
        negative_prompt="ugly",
        generator=torch.Generator().manual_seed(9),
        output_type=output_type,
    ).images
    got = out.latents if output_type == "latent" else out.array
    assert got.shape == expected.shape
    assert np.abs(np.asarray(got) - np.asarray(expected)).max() <= 1e-5


def test_sd3_batch_equals_each_alone(sd3_engine):
    sp = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=4, output_type="latent")
    batched = sd3_engine.generate(["a house", "a tall tree in a field"], sp)
    for out in batched:
        [alone] = sd3_engine.generate([out.prompt], sp)
        assert (alone.latents - out.latents).abs().max().item() <= 1e-4


def test_forced_diffusers_backend_on_z_image(tiny_z_image_dir, diffusers_z_image):
    engine = DiffusionEngine(
        OmniDiffusionConfig(
            model=str(tiny_z_image_dir), pipeline_backend="diffusers", enable_progress_bar=False
        )
    )
    try:
        assert isinstance(engine.pipeline, DiffusersFallbackPipeline)
        sp = OmniDiffusionSamplingParams(
            height=32, width=32, num_inference_steps=2, guidance_scale=2.0, seed=1, output_type="latent"
        )
        [out] = engine.generate(["a cup"], sp)
        expected = diffusers_z_image(
            "a cup",
            height=32,
            width=32,
            num_inference_steps=2,
            guidance_scale=2.0,
            generator=torch.Generator().manual_seed(1),
            output_type="latent",
        ).images
        assert (out.latents - expected).abs().max().item() <= 1e-6
    finally:
        engine.shutdown()


def test_lora_scale_controls_of_every_diffusers_spelling():
    """Issue 21 rule 6: the ``"scale"`` of ``joint_attention_kwargs`` (SD3, Flux), ``cross_attention_kwargs``
    (UNet pipelines) and ``attention_kwargs`` (Wan) is taken as the call's LoRA scale (the Wan case is checked
    against diffusers in ``tests/diffusion/test_wan_moe_targets.py``); the rest reaches diffusers and the
    request's own dict is not changed."""
    from vllm_omni.diffusion.pipelines.diffusers_fallback import LORA_SCALE_KWARGS, pop_lora_scale
    from vllm_omni.errors import InvalidRequestError

    for key in LORA_SCALE_KWARGS:
        given = {"scale": 0.25, "other": 1}
        kwargs = {key: given, "height": 32}
        assert pop_lora_scale(kwargs) == 0.25
        assert kwargs == {key: {"other": 1}, "height": 32} and given == {"scale": 0.25, "other": 1}
        kwargs = {key: {"scale": 2}}
        assert pop_lora_scale(kwargs) == 2.0 and kwargs == {}
        for bad in ("half", float("nan"), True):
            with pytest.raises(
                InvalidRequestError, match=rf"extra_args\['{key}'\]\['scale'\].*finite number"
            ):
                pop_lora_scale({key: {"scale": bad}})
        with pytest.raises(InvalidRequestError, match="must be a dict"):
            pop_lora_scale({key: 0.5})
    assert pop_lora_scale({"height": 32}) == 1.0


SD3_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def _write_sd3_adapter(model_dir, out) -> str:
    """A PEFT LoRA on the SD3 transformer's joint attention, saved as diffusers saves SD3 LoRAs
    (``StableDiffusion3Pipeline.save_lora_weights``: keys ``transformer.transformer_blocks.N....``)."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from tests.diffusion.lora_oracle import save_random_diffusers_lora

    model = SD3Transformer2DModel.from_pretrained(model_dir, subfolder="transformer")
    return str(save_random_diffusers_lora(model, StableDiffusion3Pipeline, SD3_TARGETS, 21, out))


def test_sd3_joint_attention_kwargs_scale_acts_as_in_diffusers(tiny_sd3_dir, sd3_reference, tmp_path):
    """Issue 21 rule 6 on SD3 (the diffusers fallback): ``joint_attention_kwargs={"scale": s}`` in
    ``extra_args`` scales the request's adapter as diffusers' ``scale_lora_layers`` does; values
    against ``StableDiffusion3Pipeline`` + peft on the same file."""
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.lora.request import LoRARequest

    path = _write_sd3_adapter(tiny_sd3_dir, tmp_path / "sd3_lora")
    lora = LoRARequest("sd3_lora", 1, path)
    call = dict(height=32, width=32, num_inference_steps=3, guidance_scale=4.0, output_type="latent")

    def ours(engine, **extra):
        sp = OmniDiffusionSamplingParams(seed=9, extra_args=extra, **call)
        [out] = engine.generate(["a small house"], sp, use_tqdm=False, lora_requests=[lora])
        return torch.as_tensor(out.latents).float()

    pipe = sd3_reference
    base = pipe("a small house", generator=torch.Generator().manual_seed(9), **call).images
    pipe.load_lora_weights(path, adapter_name="sd3_lora")
    try:
        full = pipe("a small house", generator=torch.Generator().manual_seed(9), **call).images
        half = pipe(
            "a small house",
            generator=torch.Generator().manual_seed(9),
            joint_attention_kwargs={"scale": 0.5},
            **call,
        ).images
    finally:
        pipe.unload_lora_weights()
    assert (full - half).abs().max().item() > 1e-2 and (full - base).abs().max().item() > 1e-2
    with Omni(str(tiny_sd3_dir), max_loras=1, dtype="float32") as engine:
        assert (ours(engine) - full).abs().max().item() <= 1e-4
        assert (ours(engine, joint_attention_kwargs={"scale": 0.5}) - half).abs().max().item() <= 1e-4
