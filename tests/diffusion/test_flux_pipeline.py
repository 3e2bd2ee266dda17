"""In-tree Flux through Omni against diffusers' FluxPipeline on the same tiny weights (fp32).

Folders: tiny FLUX.1-dev (guidance embedding, dynamic shift) and FLUX.1-schnell (no guidance embedding,
static shift) layouts from ``tools/make_tiny_flux.py``. Adapters: a PEFT folder goes into diffusers with
``transformer.load_lora_adapter`` and its config (DESIGN trap: ``load_lora_weights`` ignores PEFT
folders); single files (kohya sd-scripts ``lora_unet_double_blocks_...``, ComfyUI/BFL
``diffusion_model.double_blocks...``, XLabs ``double_blocks.0.processor.qkv_lora1...``) with ``pipe.load_lora_weights``, which runs diffusers' Flux converter;
scales with ``set_adapters``.
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
SIZE = {"height": 32, "width": 48}
COMMON = dict(num_inference_steps=2, max_sequence_length=16, **SIZE)


def params(**overrides) -> OmniDiffusionSamplingParams:
    base = dict(guidance_scale=4.0, seed=5, output_type="latent", **COMMON)
    base.update(overrides)
    return OmniDiffusionSamplingParams(**base)


def diffusers_pipe(folder, adapters=()):
    """A fresh diffusers ``FluxPipeline`` on ``folder`` with ``adapters`` (``(path, scale)``) active."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    names = []
    for i, (path, _) in enumerate(adapters):
        names.append(f"a{i}")
        if path.is_dir():
            load_peft_into_transformer(pipe.transformer, path, names[-1])
        else:
            pipe.load_lora_weights(str(path), adapter_name=names[-1])
    if names:
        pipe.set_adapters(names, [float(s) for _, s in adapters])
    return pipe


@torch.no_grad()
def diffusers_latents(pipe, prompt=PROMPT, **kw):
    kw.setdefault("output_type", "latent")
    kw.setdefault("guidance_scale", 4.0)
    return pipe(prompt=prompt, generator=torch.Generator().manual_seed(5), **COMMON, **kw).images


@pytest.fixture(scope="module")
def flux_dirs():
    from tests.conftest import test_assets_root as _assets_root
    from tools.make_tiny_flux import ensure_tiny_flux, ensure_tiny_flux_loras

    root = _assets_root()
    dev = ensure_tiny_flux(root, "dev")
    return {
        "dev": dev,
        "schnell": ensure_tiny_flux(root, "schnell"),
        "kontext": ensure_tiny_flux(root, "kontext"),
        "loras": ensure_tiny_flux_loras(dev, root),
    }


@pytest.fixture(scope="module")
def loras(flux_dirs):
    return flux_dirs["loras"]


@pytest.fixture(scope="module")
def omni(flux_dirs):
    from vllm_omni import Omni

    engine = Omni(
        model=str(flux_dirs["dev"]), dtype="float32", enable_progress_bar=False, max_loras=2, max_cpu_loras=6
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base_pipe(flux_dirs):
    return diffusers_pipe(flux_dirs["dev"])


def _latents(omni, prompt=PROMPT, **kw):
    return omni.generate(prompt=prompt, sampling_params=params(**kw))[0].latents


def _max(a, b) -> float:
    return (a - b).abs().max().item()


def test_auto_backend_runs_dev_in_tree_and_matches_diffusers(omni, base_pipe):
    stage = omni._orchestrator.runtimes[0]
    assert stage.collective_rpc("describe")[0]["pipeline"] == "FluxPipeline"
    got, expected = _latents(omni), diffusers_latents(base_pipe)
    assert got.shape == expected.shape == (1, 6, 64)  # packed 2x2 patches of the 16 x 4 x 6 latent
    assert _max(got, expected) <= TOL
    # the guidance input acts (dev has guidance_embeds), and equals diffusers at another value
    other = _latents(omni, guidance_scale=1.5)
    assert (
        _max(other, diffusers_latents(base_pipe, guidance_scale=1.5)) <= TOL and _max(other, got) > 50 * TOL
    )
    two = omni.generate(
        [PROMPT, "a blue dog"],
        params(output_type="pil", negative_prompt="blurry", extra_args={"true_cfg_scale": 3.0}),
    )
    ref = base_pipe(
        [PROMPT, "a blue dog"], negative_prompt="blurry", true_cfg_scale=3.0, guidance_scale=4.0,
        generator=torch.Generator().manual_seed(5), output_type="pil", **COMMON,
    ).images  # fmt: skip
    # one generator draws both prompts' noise in diffusers; a seed per prompt here: the first prompt agrees
    first = np.asarray(two[0].images[0], dtype=np.int16) - np.asarray(ref[0], dtype=np.int16)
    assert two[0].images[0].size == (48, 32) and np.abs(first).max() <= 1


def test_schnell_layout_matches_diffusers(flux_dirs):
    from vllm_omni import Omni

    pipe = diffusers_pipe(flux_dirs["schnell"])
    with Omni(model=str(flux_dirs["schnell"]), dtype="float32", enable_progress_bar=False) as engine:
        got = _latents(engine)
        cfg = _latents(engine, negative_prompt="blurry", extra_args={"true_cfg_scale": 3.0})
        assert _max(got, _latents(engine, guidance_scale=1.5)) == 0.0  # no guidance embedding
    assert _max(got, diffusers_latents(pipe)) <= TOL
    assert _max(cfg, diffusers_latents(pipe, negative_prompt="blurry", true_cfg_scale=3.0)) <= TOL


def test_kontext_edit_matches_diffusers(flux_dirs, loras):
    """FLUX.1-Kontext: the input image's tokens (frame 1) beside the output's; diffusers' own sizing
    arguments (``max_area``, ``_auto_resize``) keep the tiny sizes."""
    from diffusers import FluxKontextPipeline
    from PIL import Image

    from vllm_omni import Omni

    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((40, 56, 3)) * 255).astype(np.uint8)) for _ in range(2)]
    sizing = {"max_area": 32 * 48, "_auto_resize": False}
    pipe = FluxKontextPipeline.from_pretrained(str(flux_dirs["kontext"]))
    pipe.set_progress_bar_config(disable=True)
    load_peft_into_transformer(pipe.transformer, loras["attn"], "a")
    pipe.set_adapters(["a"], [0.7])
    attn = LoRARequest("attn", 1, str(loras["attn"]))
    with Omni(model=str(flux_dirs["kontext"]), dtype="float32", enable_progress_bar=False) as engine:
        assert (
            engine._orchestrator.runtimes[0].collective_rpc("describe")[0]["pipeline"]
            == "FluxKontextPipeline"
        )
        got = [
            _latents(engine, extra_args={"image": im, **sizing}, lora_requests=[attn], lora_scales=[0.7])
            for im in images
        ]
        with pytest.raises(ValueError, match=r"extra_args=\{'image'"):  # an edit without an image
            _latents(engine)
    expected = diffusers_latents(pipe, image=images[0], **sizing)
    assert _max(got[0], expected) <= TOL and _max(got[0], got[1]) > 50 * TOL  # the input image acts


@pytest.mark.parametrize("layout", ["attn", "kohya", "comfyui", "xlabs"])
def test_adapter_files_match_diffusers_at_two_scales(omni, flux_dirs, base_pipe, loras, layout):
    request = LoRARequest(layout, 1 + list(loras).index(layout), str(loras[layout]))
    pipe = diffusers_pipe(flux_dirs["dev"], [(loras[layout], 1.0)])
    base = diffusers_latents(base_pipe)
    for scale in (0.5, 1.5):
        got = _latents(omni, lora_requests=[request], lora_scales=[scale])
        pipe.set_adapters(["a0"], [scale])
        expected = diffusers_latents(pipe)
        assert _max(got, expected) <= TOL and _max(expected, base) > 50 * TOL, (layout, scale)


def test_two_adapters_compose_and_a_mixed_batch_equals_each_alone(omni, flux_dirs, loras):
    attn = LoRARequest("attn", 1, str(loras["attn"]))
    kohya = LoRARequest("kohya", 3, str(loras["kohya"]))
    both = _latents(omni, lora_requests=[attn, kohya], lora_scales=[0.8, 1.2])
    pipe = diffusers_pipe(flux_dirs["dev"], [(loras["attn"], 0.8), (loras["kohya"], 1.2)])
    assert _max(both, diffusers_latents(pipe)) <= TOL

    prompts = [PROMPT, "a blue dog", PROMPT]
    sets, scales = [[attn, kohya], [kohya], []], [[0.8, 1.2], [0.6], []]
    stage = omni._orchestrator.runtimes[0]
    before = len(stage.batch_sizes)
    outs = omni.generate(prompts, params(), lora_requests=sets, lora_scales=scales)
    assert stage.batch_sizes[before:] == [3], "the three requests must share one denoiser batch"
    assert _max(outs[0].latents, both) <= TOL
    for prompt, s, sc, out in zip(prompts[1:], sets[1:], scales[1:], outs[1:], strict=True):
        assert _max(out.latents, _latents(omni, prompt, lora_requests=s, lora_scales=sc)) <= TOL


@pytest.fixture(scope="module")
def clip_lora_file(base_pipe, tmp_path_factory):
    """A diffusers-format Flux file (``FluxPipeline.save_lora_weights``) with a denoiser part and a CLIP-L
    part (``text_encoder.*``), random r 4 / alpha 6 weights, configs in the header."""
    import copy

    from diffusers import FluxPipeline
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    parts, meta = {}, {}
    for seed, (name, model, targets) in enumerate(
        [
            ("transformer", base_pipe.transformer, ["to_q", "proj_mlp"]),
            ("text_encoder", base_pipe.text_encoder, ["q_proj", "fc1"]),
        ]
    ):
        config = LoraConfig(r=4, lora_alpha=6, target_modules=targets, init_lora_weights=False)
        peft_model = inject_adapter_in_model(config, copy.deepcopy(model))
        gen = torch.Generator().manual_seed(30 + seed)
        with torch.no_grad():
            for key, param in peft_model.named_parameters():
                if "lora_" in key:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        parts[f"{name}_lora_layers"] = get_peft_model_state_dict(peft_model)
        meta[f"{name}_lora_adapter_metadata"] = {"r": 4, "lora_alpha": 6, "target_modules": targets}
    out = tmp_path_factory.mktemp("flux_clip_lora")
    FluxPipeline.save_lora_weights(out, weight_name="lora.safetensors", **parts, **meta)
    return out / "lora.safetensors"


def test_text_encoder_part_matches_diffusers(omni, flux_dirs, clip_lora_file):
    """The file's CLIP-L part acts on the pooled prompt (``text_encoder_scale`` follows the scale), as
    diffusers' ``load_lora_weights`` applies it."""
    from vllm_omni.lora.request import RequestAdapter

    lora = LoRARequest("clip", 50, str(clip_lora_file))
    pipe = diffusers_pipe(flux_dirs["dev"], [(clip_lora_file, 1.3)])
    got = _latents(omni, lora_requests=[lora], lora_scales=[1.3])
    assert _max(got, diffusers_latents(pipe)) <= TOL
    no_te = omni.generate(PROMPT, params(), adapters=[RequestAdapter(lora, 1.3, text_encoder_scale=0.0)])
    assert _max(no_te[0].latents, got) > 50 * TOL  # the encoder part matters


def test_bad_input_is_refused_by_name_and_changes_nothing(omni, tmp_path, loras):
    from safetensors.torch import load_file, save_file

    from tools.make_tiny_flux import write_bfl_lora

    with pytest.raises(ValueError, match="height must be a multiple of 16"):
        omni.generate(PROMPT, params(height=40))
    with pytest.raises(ValueError, match=r"extra_args \['image'\] are not used"):
        omni.generate(PROMPT, params(extra_args={"image": None}))
    cached = omni.list_loras()
    tensors = load_file(str(loras["kohya"]))
    # a block the model does not have (the tiny transformer has double blocks 0 and 1)
    tensors.update({k.replace("double_blocks_1_", "double_blocks_7_"): v.clone() for k, v in tensors.items()})
    save_file(tensors, str(tmp_path / "block7.safetensors"))
    with pytest.raises(ValueError, match=r"transformer_blocks\.7\."):
        omni.generate(
            PROMPT, params(), lora_request=LoRARequest("b7", 40, str(tmp_path / "block7.safetensors"))
        )
    # the fused linear1 at tiny sizes: diffusers' converter splits it with FLUX.1's real sizes and refuses
    write_bfl_lora(tmp_path / "linear1.safetensors", 26, "kohya", linear1=True)
    with pytest.raises(ValueError, match=r"linear1\.safetensors: diffusers' Flux LoRA converter"):
        omni.generate(
            PROMPT, params(), lora_request=LoRARequest("l1", 41, str(tmp_path / "linear1.safetensors"))
        )
    assert omni.list_loras() == cached


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_adapters_match_peft_merged_into_diffusers(omni, flux_dirs, base_pipe, tmp_path, kind):
    import copy

    from peft import PeftModel

    from tools.make_tiny_diffusion_lora import build_lycoris_adapter

    targets = [
        "to_q",
        "add_k_proj",
        "to_out.0",
        "ff.net.2",
        "proj_mlp",
        "single_transformer_blocks.1.proj_out",
    ]
    folder = build_lycoris_adapter(
        flux_dirs["dev"] / "transformer", tmp_path / kind, kind, 21, targets, std=0.2,
        model_class="FluxTransformer2DModel", r=4, alpha=6.0,
    )  # fmt: skip
    got = _latents(
        omni, lora_requests=[LoRARequest(kind, 60 if kind == "loha" else 61, str(folder))], lora_scales=[0.8]
    )
    pipe = diffusers_pipe(flux_dirs["dev"])
    model = PeftModel.from_pretrained(copy.deepcopy(pipe.transformer), str(folder)).eval()
    for module in model.modules():
        if hasattr(module, "set_scale") and "default" in getattr(module, "scaling", {}):
            module.set_scale("default", 0.8)
    pipe.transformer.load_state_dict(model.merge_and_unload().state_dict())
    expected = diffusers_latents(pipe)
    assert _max(got, expected) <= TOL and _max(expected, diffusers_latents(base_pipe)) > 50 * TOL


def test_distill_fuses_a_kohya_file_as_diffusers_fuse_lora(flux_dirs, loras, base_pipe):
    from vllm_omni import Omni

    pipe = diffusers_pipe(flux_dirs["dev"])
    pipe.load_lora_weights(str(loras["kohya"]), adapter_name="fused")
    pipe.fuse_lora(lora_scale=0.7)
    pipe.unload_lora_weights()  # fused weights stay; the adapter layers go
    expected = diffusers_latents(pipe)
    kwargs = dict(lora_backend="distill", lora_path=str(loras["kohya"]), lora_scale=0.7)
    with Omni(model=str(flux_dirs["dev"]), dtype="float32", enable_progress_bar=False, **kwargs) as engine:
        assert engine.list_loras() == set()  # fused at start-up, not cached
        got = _latents(engine)
    assert _max(got, expected) <= TOL and _max(expected, diffusers_latents(base_pipe)) > 50 * TOL
