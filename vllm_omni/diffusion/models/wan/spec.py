"""The Wan family's published checkpoints (Wan2.1 and Wan2.2, diffusers format): their behaviour-selecting keys.

Values as the ``Wan-AI/*-Diffusers`` folders publish them (``model_index.json``, ``scheduler/scheduler_config.json``,
``transformer/config.json``); read from the published folders' files as quoted in public code (e.g. a Wan2.2
T2V-A14B checkpoint check quoting ``boundary_ratio`` 0.875 and the transformer keys; Wan2.2 T2V-A14B scheduler
configs quoted field by field) and diffusers' Wan docs (``flow_shift`` 3.0 for 480P, 5.0 for 720P). Every Wan
checkpoint ships ``UniPCMultistepScheduler`` with flow sigmas: integer (int64) timesteps.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.config.dit_family import DiTFamilySpec, PublishedCheckpoint, VariantKey


def wan_unipc(flow_shift: float) -> dict[str, Any]:
    """The published Wan ``scheduler_config.json`` (``UniPCMultistepScheduler``, flow sigmas) with ``flow_shift``."""
    return {
        "_class_name": "UniPCMultistepScheduler",
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "beta_start": 0.0001,
        "disable_corrector": [],
        "dynamic_thresholding_ratio": 0.995,
        "final_sigmas_type": "zero",
        "flow_shift": flow_shift,
        "lower_order_final": True,
        "num_train_timesteps": 1000,
        "predict_x0": True,
        "prediction_type": "flow_prediction",
        "rescale_betas_zero_snr": False,
        "sample_max_value": 1.0,
        "solver_order": 2,
        "solver_p": None,
        "solver_type": "bh2",
        "steps_offset": 0,
        "thresholding": False,
        "timestep_spacing": "linspace",
        "trained_betas": None,
        "use_beta_sigmas": False,
        "use_exponential_sigmas": False,
        "use_flow_sigmas": True,
        "use_karras_sigmas": False,
    }


def _denoiser(
    heads: int, ffn: int, layers: int, channels: int = 16, out: int = 16, **image
) -> dict[str, Any]:
    return {
        "_class_name": "WanTransformer3DModel",
        "added_kv_proj_dim": image.get("added_kv_proj_dim"),
        "attention_head_dim": 128,
        "cross_attn_norm": True,
        "eps": 1e-06,
        "ffn_dim": ffn,
        "freq_dim": 256,
        "image_dim": image.get("image_dim"),
        "in_channels": channels,
        "num_attention_heads": heads,
        "num_layers": layers,
        "out_channels": out,
        "patch_size": [1, 2, 2],
        "pos_embed_seq_len": None,
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 1024,
        "text_dim": 4096,
    }


_TEXT = {
    "text_encoder": ("transformers", "UMT5EncoderModel"),
    "tokenizer": ("transformers", "T5TokenizerFast"),
    "vae": ("diffusers", "AutoencoderKLWan"),
    "scheduler": ("diffusers", "UniPCMultistepScheduler"),
    "transformer": ("diffusers", "WanTransformer3DModel"),
}
_EXPERT_2 = {"transformer_2": ("diffusers", "WanTransformer3DModel")}
_CLIP = {
    "image_encoder": ("transformers", "CLIPVisionModel"),
    "image_processor": ("transformers", "CLIPImageProcessor"),
}
_ONE = {"boundary_ratio": None, "expand_timesteps": False}

PUBLISHED: tuple[PublishedCheckpoint, ...] = (
    PublishedCheckpoint(
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "WanPipeline",
        _ONE,
        _TEXT,
        wan_unipc(3.0),
        _denoiser(12, 8960, 30),
    ),
    PublishedCheckpoint(
        "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "WanPipeline",
        _ONE,
        _TEXT,
        wan_unipc(5.0),
        _denoiser(40, 13824, 40),
    ),
    PublishedCheckpoint(
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        "WanImageToVideoPipeline",
        _ONE,
        {**_TEXT, **_CLIP},
        wan_unipc(3.0),
        _denoiser(40, 13824, 40, channels=36, image_dim=1280, added_kv_proj_dim=5120),
    ),
    PublishedCheckpoint(
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "WanPipeline",
        {"boundary_ratio": 0.875, "expand_timesteps": False},
        {**_TEXT, **_EXPERT_2},
        wan_unipc(3.0),
        _denoiser(40, 13824, 40),
    ),
    PublishedCheckpoint(
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
        "WanImageToVideoPipeline",
        {"boundary_ratio": 0.9, "expand_timesteps": False},
        {**_TEXT, **_EXPERT_2},
        wan_unipc(5.0),
        _denoiser(40, 13824, 40, channels=36),
    ),
    PublishedCheckpoint(
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        "WanPipeline",
        {"boundary_ratio": None, "expand_timesteps": True},
        _TEXT,
        wan_unipc(5.0),
        _denoiser(24, 14336, 30, channels=48, out=48),
    ),
)


SPEC = DiTFamilySpec(
    name="wan",
    pipelines={
        "WanPipeline": "vllm_omni.diffusion.models.wan.pipeline:WanPipeline",
        "WanImageToVideoPipeline": "vllm_omni.diffusion.models.wan.pipeline_i2v:WanImageToVideoPipeline",
    },
    published=PUBLISHED,
    variants=(
        VariantKey("transformer/config.json", "qk_norm", ("rms_norm_across_heads",), "the q/k norm kind"),
        VariantKey("transformer/config.json", "patch_size", ([1, 2, 2],), "the patch layout"),
        VariantKey(
            "scheduler/scheduler_config.json",
            "_class_name",
            ("UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler"),
            "the scheduler",
        ),
    ),
    denoisers=("transformer", "transformer_2"),
    lora_targets=(
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
        "attn1.to_out.0",
        "attn2.*",
        "ffn.net.0.proj",
        "ffn.net.2",
    ),
    lora_formats=("ComfyUI / musubi-tuner / lightx2v (diffusers' Wan converter; diff_b bias deltas)",),
    cfg="[B positive; B negative] rows, pred = neg + g * (pos - neg); g = guidance_scale_2 on the low-noise expert",
    inputs=("image", "last_image"),
    vae_normalisation="latents * std + mean (per-channel latents_mean / latents_std)",
    image_inputs={"WanImageToVideoPipeline": "required", "WanPipeline": "optional (expand_timesteps)"},
    output_kind="video",
    # diffusers' WanImageToVideoPipeline repeats CLIP features per prompt, not per output: n = 1 there
    contract={"reference_n1_components": ("image_encoder",)},
    defaults={"guidance_scale": 5.0, "size": (480, 832), "num_frames": 81},
)

__all__ = ["PUBLISHED", "SPEC", "wan_unipc"]
