"""diffusers + peft reference for LoRA on the tiny Z-Image pipeline (the independent oracle).

DESIGN.md trap: ``pipe.load_lora_weights(<PEFT folder>)`` silently loads nothing, so adapters go
into the diffusers transformer with ``load_lora_adapter(state_dict, prefix=None, metadata=...)``
after stripping ``base_model.model.``, then ``set_adapters(names, weights)``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tools.make_tiny_diffusion_lora import adapter_config_metadata


def load_peft_into_transformer(transformer, adapter_dir: str | Path, name: str) -> None:
    """Load a PEFT folder into a diffusers transformer under adapter ``name``."""
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    state = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
    transformer.load_lora_adapter(
        state, prefix=None, adapter_name=name, metadata=adapter_config_metadata(adapter_dir)
    )


def reference_pipeline(z_image_dir: str | Path, adapters: list[tuple[str | Path, float]] = ()):
    """A fresh diffusers ``ZImagePipeline`` with ``adapters`` (``(peft_dir, scale)``) active together."""
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(z_image_dir))
    pipe.set_progress_bar_config(disable=True)
    names = []
    for i, (path, _) in enumerate(adapters):
        names.append(f"a{i}")
        load_peft_into_transformer(pipe.transformer, path, names[-1])
    if names:
        pipe.transformer.set_adapters(names, [float(s) for _, s in adapters])
    return pipe


@torch.no_grad()
def reference_latents(pipe, prompt: str, *, seed: int, steps: int, guidance: float, height: int, width: int):
    """Final latents ``(1, 16, h/8, w/8)`` of the diffusers pipeline."""
    return pipe(
        prompt,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
        height=height,
        width=width,
    ).images


def fused_reference_pipeline(z_image_dir: str | Path, lora_file: str | Path, scale: float):
    """diffusers ``ZImagePipeline`` with a single-file LoRA fused by ``transformer.fuse_lora``."""
    import json

    from diffusers import ZImagePipeline
    from safetensors import safe_open

    pipe = ZImagePipeline.from_pretrained(str(z_image_dir))
    pipe.set_progress_bar_config(disable=True)
    with safe_open(str(lora_file), "pt") as f:
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
    pipe.transformer.load_lora_adapter(
        load_file(str(lora_file)), prefix=None, adapter_name="fused", metadata=metadata
    )
    pipe.transformer.fuse_lora(lora_scale=scale)
    return pipe


def merged_reference_pipeline(z_image_dir: str | Path, adapters: list[tuple[str | Path, float]]):
    """diffusers ``ZImagePipeline`` whose transformer weights carry each peft adapter's update at its scale.

    Each adapter (LoRA, LoHa or LoKr directory) is loaded by peft (``PeftModel.from_pretrained``) into a
    copy of the transformer, scaled with the layer's ``set_scale``, merged (``merge_and_unload``), and
    its weight difference added: the sum of peft's own updates, as a composed request applies them.
    """
    import copy

    from diffusers import ZImagePipeline
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lycoris_utils import LycorisLayer

    pipe = ZImagePipeline.from_pretrained(str(z_image_dir))
    pipe.set_progress_bar_config(disable=True)
    base = pipe.transformer.state_dict()
    total = {k: v.clone() for k, v in base.items()}
    for path, scale in adapters:
        model = PeftModel.from_pretrained(copy.deepcopy(pipe.transformer), str(path)).eval()
        for module in model.modules():
            if isinstance(module, (LoraLayer, LycorisLayer)):
                module.set_scale("default", float(scale))
        for key, value in model.merge_and_unload().state_dict().items():
            total[key] += value - base[key]
    pipe.transformer.load_state_dict(total)
    return pipe


def scheduled_reference_pipeline(z_image_dir: str | Path, adapters, num_steps: int):
    """diffusers ``ZImagePipeline`` with per-step and per-module adapter scales, and its step callback.

    ``adapters``: per adapter ``(peft_dir, step_scales, multiplier)`` with ``step_scales`` one number per
    step and ``multiplier(module_name) -> float`` (diffusers module names, e.g. ``layers.1.attention.to_q``).
    Step ``i``'s weights are set with ``set_adapters`` before the call (``i = 0``) and by
    ``callback_on_step_end`` at the end of step ``i - 1``; the per-module multipliers then scale peft's
    ``scaling`` of each LoRA layer (peft's per-module scale).

    Returns ``(pipe, callback)``; pass ``callback_on_step_end=callback`` to the pipeline call.
    """
    from peft.tuners.lora import LoraLayer

    pipe = reference_pipeline(z_image_dir, [(p, steps[0]) for p, steps, _ in adapters])
    names = [f"a{i}" for i in range(len(adapters))]
    lora_layers = [(n, m) for n, m in pipe.transformer.named_modules() if isinstance(m, LoraLayer)]

    def apply(step: int) -> None:
        pipe.transformer.set_adapters(names, [float(steps[step]) for _, steps, _ in adapters])
        for module_name, module in lora_layers:
            for name, (_, _, multiplier) in zip(names, adapters, strict=True):
                if name in module.scaling:
                    module.scaling[name] *= multiplier(module_name)

    def callback(_pipe, i, _t, _kwargs):
        if i + 1 < num_steps:
            apply(i + 1)
        return {}

    apply(0)
    return pipe, callback


def save_random_diffusers_lora(
    model,
    pipeline_cls,
    targets: list[str],
    seed: int,
    out: Path,
    *,
    r: int = 4,
    alpha: float = 8,
    std: float = 0.3,
) -> Path:
    """A PEFT LoRA (rank ``r``, ``lora_alpha``, weights ~ N(0, ``std``) from ``seed``) on ``targets`` of a
    diffusers denoiser ``model``, saved as diffusers saves that pipeline's LoRAs
    (``pipeline_cls.save_lora_weights``: keys ``transformer.<module>.lora_A.weight``); the file's path."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    torch.manual_seed(seed)
    model = inject_adapter_in_model(
        LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False), model
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    pipeline_cls.save_lora_weights(
        out, transformer_lora_layers=get_peft_model_state_dict(model), weight_name="lora.safetensors"
    )
    return Path(out) / "lora.safetensors"


def text_encoder_lora_files(z_image_dir, z_loras: dict, out: Path, targets: list[str], r: int, alpha: float):
    """Adapter files with a denoiser part and a text-encoder part, in the two layouts users have, holding the
    same tensors: the tiny ``attn`` denoiser adapter (``z_loras["attn_file"]``, bare diffusers keys) and a
    random encoder adapter (``r``, ``alpha`` on ``targets`` of the tiny Z-Image's Qwen3 encoder).

    Returns:
        ``(base encoder, peft encoder (transformers+peft, the reference), paths)`` with paths
        ``"diffusers"`` (``transformer.*`` + ``text_encoder.*``, both configurations in the
        ``lora_adapter_metadata`` header as ``save_lora_weights`` writes them), ``"kohya"`` (``lora_unet_*`` +
        ``lora_te_*`` with ``.alpha``), ``"kohya_te2"`` (also a ``lora_te2_*`` part) and ``"denoiser"`` (the
        PEFT folder of the denoiser part alone).
    """
    import copy
    import json

    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
    from safetensors.torch import save_file
    from transformers import Qwen3Model

    base = Qwen3Model.from_pretrained(str(Path(z_image_dir) / "text_encoder")).eval()
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    peft_te = inject_adapter_in_model(config, copy.deepcopy(base)).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_te.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    te_sd = get_peft_model_state_dict(peft_te)  # layers.0.self_attn.q_proj.lora_A.weight, ...
    den_sd = load_file(str(z_loras["attn_file"]))  # bare diffusers keys, r 4 alpha 8
    meta = {"r": r, "lora_alpha": alpha}
    header = {f"{c}.{k}": v for c in ("transformer", "text_encoder") for k, v in meta.items()}
    paths = {"diffusers": out / "diffusers.safetensors", "kohya": out / "kohya.safetensors"}
    diffusers_sd = {f"transformer.{k}": v for k, v in den_sd.items()}
    diffusers_sd.update({f"text_encoder.{k}": v for k, v in te_sd.items()})
    save_file(diffusers_sd, str(paths["diffusers"]), metadata={"lora_adapter_metadata": json.dumps(header)})
    kohya: dict[str, torch.Tensor] = {}
    for prefix, sd in (("lora_unet_", den_sd), ("lora_te_", te_sd)):
        for key, tensor in sd.items():
            module, kind = key.rsplit(".lora_", 1)
            name = prefix + module.replace(".", "_")
            kohya[f"{name}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = tensor
            kohya[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(kohya, str(paths["kohya"]))
    te2 = dict(kohya)
    te2.update(
        {k.replace("lora_te_", "lora_te2_"): v.clone() for k, v in kohya.items() if k.startswith("lora_te_")}
    )
    paths["kohya_te2"] = out / "kohya_te2.safetensors"
    save_file(te2, str(paths["kohya_te2"]))
    paths["denoiser"] = z_loras["attn"]
    return base, peft_te, paths


def peft_scaled(peft_te, scale: float):
    """A copy of a peft-injected encoder whose adapter applies at ``scale`` (peft's ``set_scale``)."""
    import copy

    from peft.tuners.lora import LoraLayer

    model = copy.deepcopy(peft_te)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.set_scale("default", scale)
    return model
