"""The Z-Image family (``Tongyi-MAI/Z-Image-Turbo``, diffusers format): published keys and what is served.

Values as the published folder has them (``model_index.json``, ``scheduler/scheduler_config.json``: flow-match
Euler, static shift 3; ``transformer/config.json``), read from the published files as diffusers' Z-Image
docs and model card quote them.
"""

from __future__ import annotations

from vllm_omni.config.dit_family import DiTFamilySpec, PublishedCheckpoint, VariantKey

PUBLISHED: tuple[PublishedCheckpoint, ...] = (
    PublishedCheckpoint(
        "Tongyi-MAI/Z-Image-Turbo",
        "ZImagePipeline",
        {},
        {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": ("transformers", "Qwen3Model"),
            "tokenizer": ("transformers", "Qwen2Tokenizer"),
            "transformer": ("diffusers", "ZImageTransformer2DModel"),
            "vae": ("diffusers", "AutoencoderKL"),
        },
        {
            "_class_name": "FlowMatchEulerDiscreteScheduler",
            "num_train_timesteps": 1000,
            "shift": 3.0,
            "use_dynamic_shifting": False,
        },
        {
            "_class_name": "ZImageTransformer2DModel",
            "all_f_patch_size": [1],
            "all_patch_size": [2],
            "axes_dims": [32, 48, 48],
            "axes_lens": [1536, 512, 512],
            "cap_feat_dim": 2560,
            "dim": 3840,
            "in_channels": 16,
            "n_heads": 30,
            "n_kv_heads": 30,
            "n_layers": 30,
            "n_refiner_layers": 2,
            "norm_eps": 1e-05,
            "qk_norm": True,
            "rope_theta": 256.0,
            "t_scale": 1000.0,
        },
        sources="Tongyi-MAI/Z-Image-Turbo folder files (model card, diffusers Z-Image docs)",
    ),
)

SPEC = DiTFamilySpec(
    name="z_image",
    pipelines={"ZImagePipeline": "vllm_omni.diffusion.models.z_image.pipeline:ZImagePipeline"},
    published=PUBLISHED,
    variants=(
        VariantKey("transformer/config.json", "siglip_feat_dim", (None,), "the Z-Image omni variant"),
        VariantKey(
            "scheduler/scheduler_config.json",
            "_class_name",
            ("FlowMatchEulerDiscreteScheduler",),
            "the scheduler",
        ),
    ),
    lora_targets=(
        "attention.to_q",
        "attention.to_k",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    ),
    lora_formats=("diffusers / PEFT", "kohya / ComfyUI (diffusers' Z-Image converter)"),
    cfg="[B positive; B negative] rows when guidance_scale > 0, pred = pos + g * (pos - neg); velocity = -pred",
    vae_normalisation="latents / scaling_factor + shift_factor",
    cfg_threshold=0.0,
    defaults={"guidance_scale": 5.0, "size": "the VAE's sample_size (1024)"},
)

__all__ = ["PUBLISHED", "SPEC"]
