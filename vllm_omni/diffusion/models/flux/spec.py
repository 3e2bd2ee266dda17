"""The Flux family (FLUX.1-dev / schnell / Kontext-dev, diffusers format): the classes served and what they read.

The published values (``black-forest-labs/FLUX.1-dev``, ``FLUX.1-schnell``, ``FLUX.1-Kontext-dev``:
``transformer/config.json`` with 19 double and 38 single blocks, ``guidance_embeds`` true for dev and Kontext,
false for schnell; ``scheduler/scheduler_config.json``: flow-match Euler, shift 3.0 with dynamic shifting over
256..4096 tokens (0.5 -> 1.15) for dev / Kontext, shift 1.0 without for schnell) are what
``tools/make_tiny_flux.py`` builds its tiny folders from; ``tests/diffusion/test_flux_pipeline.py`` compares
them with diffusers; the contract test builds FLUX.1-dev and FLUX.1-schnell from ``PUBLISHED``
(``tools/make_tiny_dit.py``).
"""

from __future__ import annotations

from vllm_omni.config.dit_family import DiTFamilySpec, PublishedCheckpoint, VariantKey

SCHEDULER_DEV = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
SCHEDULER_SCHNELL = {**SCHEDULER_DEV, "shift": 1.0, "use_dynamic_shifting": False}
DENOISER_DEV = {
    "_class_name": "FluxTransformer2DModel",
    "attention_head_dim": 128,
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
DENOISER_SCHNELL = {**DENOISER_DEV, "guidance_embeds": False}
_COMPONENTS = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "CLIPTextModel"),
    "text_encoder_2": ("transformers", "T5EncoderModel"),
    "tokenizer": ("transformers", "CLIPTokenizer"),
    "tokenizer_2": ("transformers", "T5TokenizerFast"),
    "transformer": ("diffusers", "FluxTransformer2DModel"),
    "vae": ("diffusers", "AutoencoderKL"),
}

#: FLUX.1-Kontext-dev (dev's records with ``FluxKontextPipeline``) is left out: diffusers sizes its output to
#: ``max_area`` (1024 ** 2) and its input image to a Kontext training resolution, too big for the contract's
#: tiny runs; ``tests/diffusion/test_flux_pipeline.py`` compares it at tiny sizes.
PUBLISHED: tuple[PublishedCheckpoint, ...] = (
    PublishedCheckpoint(
        "black-forest-labs/FLUX.1-dev", "FluxPipeline", {}, _COMPONENTS, SCHEDULER_DEV, DENOISER_DEV
    ),
    PublishedCheckpoint(
        "black-forest-labs/FLUX.1-schnell",
        "FluxPipeline",
        {},
        _COMPONENTS,
        SCHEDULER_SCHNELL,
        DENOISER_SCHNELL,
    ),
)

SPEC = DiTFamilySpec(
    name="flux",
    pipelines={
        "FluxPipeline": "vllm_omni.diffusion.models.flux.pipeline:FluxPipeline",
        "FluxKontextPipeline": "vllm_omni.diffusion.models.flux.pipeline_kontext:FluxKontextPipeline",
    },
    published=PUBLISHED,
    variants=(
        VariantKey("transformer/config.json", "patch_size", (1,), "Flux checkpoints use patch_size 1"),
        VariantKey(
            "scheduler/scheduler_config.json",
            "_class_name",
            ("FlowMatchEulerDiscreteScheduler",),
            "the scheduler",
        ),
    ),
    lora_targets=(
        "to_q",
        "to_k",
        "to_v",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_out.0",
        "to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
        "norm1.linear",
        "norm1_context.linear",
        "proj_mlp",
        "proj_out",
        "norm.linear",
    ),
    lora_formats=(
        "diffusers / PEFT",
        "kohya sd-scripts and ComfyUI / BFL names (diffusers' kohya Flux converter; linear1 split into q/k/v/mlp)",
        "XLabs (diffusers' XLabs converter)",
    ),
    cfg="[B positive; B negative] rows when extra_args true_cfg_scale > 1 and a negative prompt is given; "
    "neg + s (pos - neg); guidance_scale is the distilled guidance (guidance_embeds)",
    inputs=("image",),
    image_inputs={"FluxKontextPipeline": "required"},
    vae_normalisation="latents / scaling_factor + shift_factor",
    defaults={"guidance_scale": 3.5, "size": (1024, 1024)},
    contract={"max_sequence_length": 32},  # T5 prompts are padded to it: 512 tokens make tiny runs slow
)

__all__ = ["PUBLISHED", "SPEC"]
