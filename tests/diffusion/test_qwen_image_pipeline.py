"""In-tree Qwen-Image through Omni against diffusers' QwenImagePipeline on the same tiny weights (fp32).

The reference for adapters is diffusers itself: single-file adapters go through
``pipe.load_lora_weights`` (which runs diffusers' Qwen-Image converter on kohya / ComfyUI keys) and a
PEFT folder through ``transformer.load_lora_adapter`` with its config as metadata (DESIGN trap:
``load_lora_weights`` ignores PEFT folders); the scale is set with ``set_adapters``. Every run has
true CFG on (a negative prompt), so the LoRA rows include the CFG copies.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_oracle import load_peft_into_transformer

from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest

TOL = 1e-4
PROMPT = "a red cat on a mat"
NEG = "blurry"
SIZE = {"height": 32, "width": 48}


def params(**overrides) -> OmniDiffusionSamplingParams:
    base = dict(
        num_inference_steps=2, guidance_scale=4.0, negative_prompt=NEG, seed=5, output_type="latent", **SIZE
    )
    base.update(overrides)
    return OmniDiffusionSamplingParams(**base)


def diffusers_pipe(folder):
    """A fresh diffusers ``QwenImagePipeline`` on ``folder`` (the reference)."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def diffusers_latents(pipe, prompt=PROMPT, **kw):
    """diffusers' output for the settings of :func:`params` (``kw``: more call arguments)."""
    kw.setdefault("output_type", "latent")
    return pipe(
        prompt,
        negative_prompt=NEG,
        true_cfg_scale=4.0,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(5),
        **SIZE,
        **kw,
    ).images


@pytest.fixture(scope="module")
def loras(tiny_qwen_image_loras):
    return tiny_qwen_image_loras


@pytest.fixture(scope="module")
def omni(tiny_qwen_image_dir):
    from vllm_omni import Omni

    engine = Omni(
        model=str(tiny_qwen_image_dir),
        dtype="float32",
        enable_progress_bar=False,
        max_loras=2,
        max_cpu_loras=6,
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_qwen_image_dir):
    """``run(adapter_path=None, scale=1.0, prompt=PROMPT, output_type="latent", n=1)``: diffusers' output."""
    pipes: dict = {}

    def pipe_for(path):
        if path not in pipes:
            pipe = diffusers_pipe(tiny_qwen_image_dir)
            if path is not None and path.is_dir():
                load_peft_into_transformer(pipe.transformer, path, "a")
            elif path is not None:
                pipe.load_lora_weights(str(path), adapter_name="a")
            pipes[path] = pipe
        return pipes[path]

    def run(path=None, scale=1.0, prompt=PROMPT, output_type="latent", n=1):
        pipe = pipe_for(path)
        if path is not None:
            pipe.set_adapters(["a"], [scale])
        return diffusers_latents(pipe, prompt, output_type=output_type, num_images_per_prompt=n)

    return run


def _latents(omni, prompt=PROMPT, **kw):
    return omni.generate(prompt=prompt, sampling_params=params(**kw))[0].latents


def test_auto_backend_runs_in_tree_and_matches_diffusers(omni, reference):
    stage = omni._orchestrator.runtimes[0]
    assert stage.collective_rpc("describe")[0]["pipeline"] == "QwenImagePipeline"
    got = _latents(omni)
    expected = reference()
    assert got.shape == expected.shape == (1, 6, 64)  # packed 2x2 patches of the 16 x 4 x 6 latent
    assert (got - expected).abs().max().item() <= TOL
    two = _latents(omni, num_images_per_prompt=2)
    assert (two - reference(n=2)).abs().max().item() <= TOL and two.shape == (2, 6, 64)
    image = omni.generate(PROMPT, params(output_type="pil"))[0].images[0]
    expected_image = reference(output_type="pil")[0]
    assert image.size == expected_image.size == (48, 32)
    diff = np.asarray(image, dtype=np.int16) - np.asarray(expected_image, dtype=np.int16)
    assert np.abs(diff).max() <= 1


@pytest.mark.parametrize("layout", ["attn", "attn_diffusers", "attn_kohya", "attn_comfyui", "attn_lightx2v"])
def test_adapter_layouts_match_diffusers_at_two_scales(omni, reference, loras, layout):
    request = LoRARequest(layout, 1 + list(loras).index(layout), str(loras[layout]))
    base = reference()
    for scale in (0.5, 1.5):
        got = _latents(omni, lora_requests=[request], lora_scales=[scale])
        expected = reference(loras[layout], scale)
        err, effect = (got - expected).abs().max().item(), (expected - base).abs().max().item()
        assert err <= TOL and effect > 50 * TOL, (layout, scale, err, effect)


def test_mixed_adapter_batch_equals_each_alone(omni, loras):
    attn = LoRARequest("attn", 1, str(loras["attn"]))
    mlp = LoRARequest("mlp", 2, str(loras["mlp"]))
    prompts = ["a red cat on a mat", "a blue dog", "a red cat on a mat"]
    sets, scales = [[attn], [mlp], []], [[0.7], [1.2], []]
    stage = omni._orchestrator.runtimes[0]
    before = len(stage.batch_sizes)
    outs = omni.generate(prompts, params(), lora_requests=sets, lora_scales=scales)
    assert stage.batch_sizes[before:] == [3], "the three requests must share one denoiser batch"
    for prompt, s, sc, out in zip(prompts, sets, scales, outs, strict=True):
        solo = _latents(omni, prompt, lora_requests=s, lora_scales=sc)
        assert (out.latents - solo).abs().max().item() <= TOL, (prompt, [r.lora_name for r in s])
    assert (outs[0].latents - outs[2].latents).abs().max().item() > 50 * TOL  # the adapter acted


def test_per_step_schedule_matches_diffusers_step_callback(omni, tiny_qwen_image_dir, loras):
    steps = [1.5, 0.25]
    got = _latents(omni, lora_requests=[LoRARequest("attn", 1, str(loras["attn"]))], lora_scales=[steps])
    pipe = diffusers_pipe(tiny_qwen_image_dir)
    load_peft_into_transformer(pipe.transformer, loras["attn"], "a")
    pipe.set_adapters(["a"], [steps[0]])

    def callback(_pipe, i, _t, _kwargs):
        if i + 1 < len(steps):
            pipe.set_adapters(["a"], [steps[i + 1]])
        return {}

    expected = diffusers_latents(pipe, callback_on_step_end=callback)
    assert (got - expected).abs().max().item() <= TOL
    constant = _latents(omni, lora_requests=[LoRARequest("attn", 1, str(loras["attn"]))], lora_scales=[1.5])
    assert (got - constant).abs().max().item() > 50 * TOL  # the second step's scale mattered


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(height=40), "height must be a multiple of 16"),
        (dict(extra_args={"num_frames": 3}), r"extra_args \['num_frames'\] are not used"),
        (dict(max_sequence_length=2048), "max_sequence_length must be at most 1024"),
    ],
    ids=["size", "extra-arg", "sequence"],
)
def test_bad_requests_are_refused_by_name(omni, kwargs, match):
    with pytest.raises(ValueError, match=match):
        omni.generate(PROMPT, params(**kwargs))


def test_adapter_for_another_model_is_refused_and_changes_nothing(omni, tiny_z_image_loras):
    cached = omni.list_loras()
    with pytest.raises(ValueError, match=r"layers\.0\.attention"):
        omni.generate(PROMPT, params(), lora_request=LoRARequest("z", 40, str(tiny_z_image_loras["attn"])))
    assert omni.list_loras() == cached


def test_distill_fuses_a_lightning_file_as_diffusers_fuse_lora(tiny_qwen_image_dir, loras, reference):
    """lightx2v's Lightning layout (bare module names, lora_down / lora_up, .alpha) on the distill backend."""
    from vllm_omni import Omni

    pipe = diffusers_pipe(tiny_qwen_image_dir)
    pipe.load_lora_weights(str(loras["attn_lightx2v"]), adapter_name="lightning")
    pipe.fuse_lora(lora_scale=0.7)
    pipe.unload_lora_weights()  # fused weights stay; the adapter layers go
    expected = diffusers_latents(pipe)
    kwargs = dict(lora_backend="distill", lora_path=str(loras["attn_lightx2v"]), lora_scale=0.7)
    with Omni(model=str(tiny_qwen_image_dir), dtype="float32", enable_progress_bar=False, **kwargs) as omni:
        assert omni.list_loras() == set()  # fused at start-up, not cached
        got = _latents(omni)
    assert (got - expected).abs().max().item() <= TOL
    assert (expected - reference()).abs().max().item() > 50 * TOL


def test_per_block_schedule_matches_peft_per_module_scaling(omni, tiny_qwen_image_dir, loras):
    from peft.tuners.lora import LoraLayer

    request = LoRARequest("attn", 1, str(loras["attn"]))
    schedule = {"steps": 1.2, "blocks": {"transformer_blocks.1": 0.0, "transformer_blocks.0.attn": 0.5}}
    got = _latents(omni, lora_requests=[request], lora_scales=[schedule])
    pipe = diffusers_pipe(tiny_qwen_image_dir)
    load_peft_into_transformer(pipe.transformer, loras["attn"], "a")
    pipe.set_adapters(["a"], [1.2])
    for name, module in pipe.transformer.named_modules():
        if isinstance(module, LoraLayer) and "a" in module.scaling:
            if name.startswith("transformer_blocks.1."):
                module.scaling["a"] *= 0.0
            elif name.startswith("transformer_blocks.0.attn."):
                module.scaling["a"] *= 0.5
    expected = diffusers_latents(pipe)
    assert (got - expected).abs().max().item() <= TOL
    flat = _latents(omni, lora_requests=[request], lora_scales=[1.2])
    assert (got - flat).abs().max().item() > 50 * TOL  # the block multipliers mattered


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_adapters_match_peft_merged_into_diffusers(omni, tiny_qwen_image_dir, tmp_path, kind):
    import copy

    from peft import PeftModel

    from tools.make_tiny_diffusion_lora import build_lycoris_adapter

    targets = ["to_q", "add_k_proj", "to_out.0", "img_mlp.net.2", "txt_mod.1"]
    folder = build_lycoris_adapter(
        tiny_qwen_image_dir / "transformer", tmp_path / kind, kind, 21, targets, std=0.2,
        model_class="QwenImageTransformer2DModel", r=4, alpha=6.0,
    )  # fmt: skip
    request = LoRARequest(kind, 30 if kind == "loha" else 31, str(folder))
    got = _latents(omni, lora_requests=[request], lora_scales=[0.8])
    pipe = diffusers_pipe(tiny_qwen_image_dir)
    base = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    model = PeftModel.from_pretrained(copy.deepcopy(pipe.transformer), str(folder)).eval()
    for module in model.modules():
        if hasattr(module, "set_scale") and "default" in getattr(module, "scaling", {}):
            module.set_scale("default", 0.8)
    merged = model.merge_and_unload().state_dict()
    pipe.transformer.load_state_dict({k: base[k] + (merged[k] - base[k]) for k in base})
    expected = diffusers_latents(pipe)
    assert (got - expected).abs().max().item() <= TOL
    assert (expected - diffusers_latents(diffusers_pipe(tiny_qwen_image_dir))).abs().max().item() > 50 * TOL
