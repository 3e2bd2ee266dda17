"""The Qwen-Image family (text-to-image and image edit, diffusers format): published keys and what is served.

Values as the ``Qwen/Qwen-Image*`` folders publish them (``model_index.json``; ``scheduler/scheduler_config.json``:
flow-match Euler with exponential dynamic shifting up to 0.9 over 256..8192 tokens and ``shift_terminal`` 0.02;
``transformer/config.json``), read from the published files as diffusers' Qwen-Image docs quote them.
Qwen-Image-Edit-2509 publishes ``QwenImageEditPlusPipeline`` (several input images): not served in-tree yet
(the stage runs it through diffusers).
"""

from __future__ import annotations

from vllm_omni.config.dit_family import DiTFamilySpec, PublishedCheckpoint, VariantKey

#: the published Qwen-Image scheduler_config.json
SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
DENOISER = {
    "_class_name": "QwenImageTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,
    "num_attention_heads": 24,
    "num_layers": 60,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 768,
}
_TEXT = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "transformer": ("diffusers", "QwenImageTransformer2DModel"),
    "vae": ("diffusers", "AutoencoderKLQwenImage"),
}
_EDIT = {**_TEXT, "processor": ("transformers", "Qwen2VLProcessor")}

PUBLISHED: tuple[PublishedCheckpoint, ...] = (
    PublishedCheckpoint("Qwen/Qwen-Image", "QwenImagePipeline", {}, _TEXT, SCHEDULER, DENOISER),
    PublishedCheckpoint("Qwen/Qwen-Image-2512", "QwenImagePipeline", {}, _TEXT, SCHEDULER, DENOISER),
    PublishedCheckpoint("Qwen/Qwen-Image-Edit", "QwenImageEditPipeline", {}, _EDIT, SCHEDULER, DENOISER),
)

_NOT = (None, False)
SPEC = DiTFamilySpec(
    name="qwen_image",
    pipelines={
        "QwenImagePipeline": "vllm_omni.diffusion.models.qwen_image.pipeline:QwenImagePipeline",
        "QwenImageEditPipeline": "vllm_omni.diffusion.models.qwen_image.pipeline_edit:QwenImageEditPipeline",
    },
    published=PUBLISHED,
    variants=(
        VariantKey(
            "transformer/config.json", "zero_cond_t", _NOT, "Qwen-Image-Edit-2511's zero-timestep condition"
        ),
        VariantKey(
            "transformer/config.json", "use_additional_t_cond", _NOT, "the additional timestep condition"
        ),
        VariantKey("transformer/config.json", "use_layer3d_rope", _NOT, "Qwen-Image-Layered's layer RoPE"),
        VariantKey("transformer/config.json", "guidance_embeds", _NOT, "guidance embeddings"),
        VariantKey(
            "scheduler/scheduler_config.json",
            "_class_name",
            ("FlowMatchEulerDiscreteScheduler",),
            "the scheduler",
        ),
    ),
    lora_targets=(
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "img_mlp.*",
        "txt_mlp.*",
    ),
    lora_formats=("diffusers / PEFT", "kohya / musubi-tuner / ComfyUI (diffusers' Qwen-Image converter)"),
    cfg="[B positive; B negative] rows when true_cfg_scale > 1 and a negative prompt is given; "
    "comb = neg + s * (pos - neg), rescaled per token to |pos|",
    inputs=("image",),
    vae_normalisation="latents * std + mean (per-channel latents_mean / latents_std)",
    guidance_argument="true_cfg_scale",
    image_inputs={"QwenImageEditPipeline": "required"},
    contract={
        "reference_loaders": {"processor": "vllm_omni.models.torchvision_free:load_qwen2_vl_processor"},
        "condition_area": (
            64 * 64,
            "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit:calculate_dimensions",
        ),
    },
    defaults={"guidance_scale": 4.0, "size": (1024, 1024)},
)

__all__ = ["DENOISER", "PUBLISHED", "SCHEDULER", "SPEC"]
