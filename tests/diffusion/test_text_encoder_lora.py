"""Text-encoder LoRA (issue 35 item 3): adapter files whose text-encoder parts act on the pipeline's text
encoder(s), against transformers+peft on the tiny Z-Image's encoder and on the in-tree pipeline.

Files: a diffusers-keyed one (``transformer.*`` + ``text_encoder.*``, both configurations in the
``lora_adapter_metadata`` header, as ``save_lora_weights`` writes them) and a kohya one (``lora_unet_*`` +
``lora_te_*`` with ``.alpha``), holding the same tensors: the tiny ``attn`` denoiser adapter (r 4, alpha 8)
and a random encoder adapter (r 4, alpha 8 on q/v/down projections).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.diffusion.lora_oracle import peft_scaled, text_encoder_lora_files
from vllm_omni.lora.request import LoRARequest, RequestAdapter, RequestAdapters

TE_TARGETS = ["q_proj", "v_proj", "down_proj"]
R, ALPHA = 4, 8.0
PROMPTS = ["a red square", "two blue circles"]


@pytest.fixture(scope="module")
def te_setup(tiny_z_image_dir, tiny_z_image_loras, tmp_path_factory):
    """``(base encoder, peft encoder, {"diffusers", "kohya", "kohya_te2", "denoiser"}: path)``."""
    return text_encoder_lora_files(
        tiny_z_image_dir, tiny_z_image_loras, tmp_path_factory.mktemp("te_lora"), TE_TARGETS, R, ALPHA
    )


def _hidden(encoder, ids, mask) -> torch.Tensor:
    return encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]


@torch.no_grad()
@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
def test_encoder_output_equals_peft(te_setup, layout):
    """(a) A batch of two prompts through the encoder: prompt 0 with the file's text-encoder part at 0.7,
    prompt 1 without; each row equals transformers+peft (same tensors, ``set_scale``) / the base encoder."""
    from vllm_omni.diffusion.lora.text_encoder_lora import TextEncoderLoRA

    base, peft_te, paths = te_setup
    ours = copy.deepcopy(base)
    te = TextEncoderLoRA(types.SimpleNamespace(text_encoder=ours), "test", max_loras=2, max_rank=8)
    lora = LoRARequest(layout, 1, str(paths[layout]))
    denoiser_part = te.read(lora.lora_path)
    assert denoiser_part.modules and not denoiser_part.text_encoders
    te.note_loaded([lora])
    assert te.users(lora) == ["text_encoder"]
    te.managers["text_encoder"].add_lora(lora)
    te.done_loading()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    with te.activate([RequestAdapters.of(lora, 0.7), RequestAdapters()], [0, 1]):
        got = _hidden(ours, ids, mask)
    want0 = _hidden(peft_scaled(peft_te, 0.7), ids[:1], mask[:1])
    want1 = _hidden(base, ids[1:], mask[1:])
    errs = [(got[:1] - want0).abs().max().item(), (got[1:] - want1).abs().max().item()]
    assert max(errs) <= 1e-5, errs
    assert (want0 - _hidden(base, ids[:1], mask[:1])).abs().max().item() > 1e-2


@pytest.fixture(scope="module")
def engine(tiny_z_image_dir):
    """In-process fp32 CPU engine on the tiny Z-Image with two adapter slots (a mixed batch)."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    config = OmniDiffusionConfig(
        model=str(tiny_z_image_dir), dtype="float32", device="cpu", enable_progress_bar=False, max_loras=2
    )
    with DiffusionEngine(config) as eng:
        yield eng


def _run(engine, prompts, sets, seed: int = 3) -> list[torch.Tensor]:
    """Final latents per prompt (CFG on: negative texts go through the encoder too)."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.lora.request import RequestAdapters

    sp = OmniDiffusionSamplingParams(
        height=32, width=32, num_inference_steps=2, guidance_scale=3.0, output_type="latent", seed=seed
    )
    outs = engine.worker.generate_batch(
        list(prompts), sp, [RequestAdapters(tuple(s)) for s in sets], [seed] * len(prompts)
    )
    for out in outs:
        if isinstance(out, BaseException):
            raise out
    return [out.latents for out in outs]


@torch.no_grad()
def test_in_tree_z_image_equals_hand_reference_and_mixed_batch(engine, te_setup):
    """(c) Latents with a file's denoiser + text-encoder parts equal the pipeline run with the denoiser part
    alone (the PEFT folder of the same tensors) and the encoder replaced by transformers+peft at the
    adapter's ``text_encoder_scale``; kohya at scale 0.8 with ``text_encoder_scale`` 1.5, diffusers at 0.6
    (the encoder follows the scale); the two prompts in one batch equal each alone."""
    _, peft_te, paths = te_setup
    pipe = engine.worker.pipeline
    kohya = RequestAdapter(LoRARequest("kohya", 21, str(paths["kohya"])), 0.8, text_encoder_scale=1.5)
    diffusers = RequestAdapter(LoRARequest("diffusers", 22, str(paths["diffusers"])), 0.6)
    denoiser = LoRARequest("attn", 23, str(paths["denoiser"]))
    batched = _run(engine, PROMPTS, [[kohya], [diffusers]])
    alone = _run(engine, PROMPTS[:1], [[kohya]]) + _run(engine, PROMPTS[1:], [[diffusers]])
    original = pipe.text_encoder
    try:
        pipe.text_encoder = peft_scaled(peft_te, 1.5)
        reference = _run(engine, PROMPTS[:1], [[RequestAdapter(denoiser, 0.8)]])
        pipe.text_encoder = peft_scaled(peft_te, 0.6)
        reference += _run(engine, PROMPTS[1:], [[RequestAdapter(denoiser, 0.6)]])
    finally:
        pipe.text_encoder = original
    without_te = _run(engine, PROMPTS[:1], [[RequestAdapter(denoiser, 0.8)]])[0]
    for got, one, want in zip(batched, alone, reference, strict=True):
        assert (got - want).abs().max().item() <= 1e-4
        assert (got - one).abs().max().item() <= 1e-5
    assert (reference[0] - without_te).abs().max().item() > 1e-3  # the encoder part matters


def test_part_for_a_missing_encoder_is_refused_naming_keys(engine, te_setup):
    """(e) ``lora_te2_*`` on a one-encoder pipeline: refused naming the keys; nothing cached anywhere."""
    from vllm_omni.errors import LoRAFormatError

    lora_state = engine.worker.lora
    managers = [*lora_state.managers.values(), *lora_state.text_encoders.managers.values()]
    before = [m.list_loras() for m in managers]
    bad = LoRARequest("te2", 24, str(te_setup[2]["kohya_te2"]))
    with pytest.raises(LoRAFormatError, match=r"text_encoder_2.*lora_te2_layers_0_self_attn_q_proj"):
        lora_state.add_lora(bad)
    with pytest.raises(LoRAFormatError, match="lora_te2_"):
        _run(engine, PROMPTS[:1], [[RequestAdapter(bad)]])
    assert [m.list_loras() for m in managers] == before


SD3_PARTS = (  # component, targets, r, lora_alpha, seed
    ("transformer", ["to_q", "to_k", "to_v", "add_q_proj"], 4, 8.0, 31),
    ("text_encoder", ["q_proj", "v_proj", "out_proj"], 4, 2.0, 32),
    ("text_encoder_2", ["k_proj", "fc1"], 2, 4.0, 33),
)
SD3_CALL = dict(height=32, width=32, num_inference_steps=2, guidance_scale=4.0, output_type="latent")


@pytest.fixture(scope="module")
def sd3_file(tiny_sd3_dir, tmp_path_factory) -> str:
    """A LoRA on the tiny SD3's transformer and both CLIP encoders (alpha != r), saved by
    ``StableDiffusion3Pipeline.save_lora_weights`` with each component's configuration as metadata."""
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir), text_encoder_3=None, tokenizer_3=None)
    kwargs = {}
    for component, targets, r, alpha, seed in SD3_PARTS:
        config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
        model = inject_adapter_in_model(config, getattr(pipe, component))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        kwargs[f"{component}_lora_layers"] = get_peft_model_state_dict(model)
        kwargs[f"{component}_lora_adapter_metadata"] = {
            "r": r,
            "lora_alpha": alpha,
            "target_modules": targets,
        }
    out = tmp_path_factory.mktemp("sd3_te_lora")
    StableDiffusion3Pipeline.save_lora_weights(out, weight_name="lora.safetensors", **kwargs)
    return str(out / "lora.safetensors")


def _diffusers_sd3(tiny_sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir), text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sd3_engine(tiny_sd3_dir, **lora):
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    return DiffusionEngine(
        OmniDiffusionConfig(model=str(tiny_sd3_dir), dtype="float32", enable_progress_bar=False, **lora)
    )


@torch.no_grad()
def test_diffusers_fallback_equals_load_lora_weights_and_set_adapters(tiny_sd3_dir, sd3_file):
    """(b) SD3 through the diffusers fallback: denoiser and both text-encoder parts at scale 0.7 equal
    diffusers' ``load_lora_weights`` + ``set_adapters([name], [0.7])`` (which weights the text encoders
    too); without its text-encoder parts the output differs."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.lora.request import RequestAdapters

    pipe = _diffusers_sd3(tiny_sd3_dir)
    pipe.load_lora_weights(sd3_file, adapter_name="x")
    pipe.set_adapters(["x"], [0.7])
    want = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(4), **SD3_CALL).images
    pipe.set_adapters(["x"], [{"transformer": 0.7, "text_encoder": 0.0, "text_encoder_2": 0.0}])
    denoiser_only = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(4), **SD3_CALL).images
    lora = LoRARequest("x", 41, sd3_file)
    with _sd3_engine(tiny_sd3_dir) as engine:
        sp = OmniDiffusionSamplingParams(seed=4, **SD3_CALL)
        [out] = engine.worker.generate_batch(PROMPTS[:1], sp, [RequestAdapters((RequestAdapter(lora, 0.7),))])
        assert engine.worker.lora.text_encoders.users(lora) == ["text_encoder", "text_encoder_2"]
        [te_off] = engine.worker.generate_batch(
            PROMPTS[:1], sp, [RequestAdapters((RequestAdapter(lora, 0.7, text_encoder_scale=0.0),))]
        )
    got = torch.as_tensor(out.latents)
    assert (got - want).abs().max().item() <= 1e-4
    assert (torch.as_tensor(te_off.latents) - denoiser_only).abs().max().item() <= 1e-4
    assert (want - denoiser_only).abs().max().item() > 1e-3


@torch.no_grad()
def test_distill_equals_diffusers_fuse_lora(tiny_sd3_dir, sd3_file):
    """(d) The distill backend fuses the file's denoiser and text-encoder parts at ``lora_scale`` 0.7, as
    diffusers' ``fuse_lora(components=[transformer, text_encoder, text_encoder_2], lora_scale=0.7)``."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    pipe = _diffusers_sd3(tiny_sd3_dir)
    pipe.load_lora_weights(sd3_file, adapter_name="x")
    pipe.fuse_lora(components=["transformer", "text_encoder", "text_encoder_2"], lora_scale=0.7)
    pipe.unload_lora_weights()
    want = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(4), **SD3_CALL).images
    with _sd3_engine(tiny_sd3_dir, lora_backend="distill", lora_path=sd3_file, lora_scale=0.7) as engine:
        assert set(engine.worker.lora.fused) == {"transformer", "text_encoder", "text_encoder_2"}
        [out] = engine.generate(PROMPTS[:1], OmniDiffusionSamplingParams(seed=4, **SD3_CALL))
    assert (torch.as_tensor(out.latents) - want).abs().max().item() <= 1e-4


@torch.no_grad()
def test_kohya_two_encoder_file_reads_as_the_diffusers_file(tiny_sd3_dir, sd3_file, tmp_path):
    """The SD3 file's text-encoder parts rewritten as kohya writes SDXL ones (``lora_te1_text_model_<flat>`` /
    ``lora_te2_text_model_<flat>``, ``lora_down`` / ``lora_up``, ``.alpha`` instead of the header's
    configuration) give both CLIP encoders the same outputs as the diffusers-keyed file."""
    from transformers import CLIPTextModelWithProjection

    from vllm_omni.diffusion.lora.text_encoder_lora import TextEncoderLoRA

    alphas = {c: a for c, _, _, a, _ in SD3_PARTS}
    kohya = {}
    for key, tensor in load_file(sd3_file).items():
        component, rest = key.split(".", 1)
        module, kind = rest.rsplit(".lora_", 1)
        prefix = {"transformer": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}[
            component
        ]
        flat = prefix + module.replace(".", "_")
        kohya[f"{flat}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = tensor
        kohya[f"{flat}.alpha"] = torch.tensor(alphas[component])
    save_file(kohya, str(tmp_path / "kohya.safetensors"))
    encoders = {
        c: CLIPTextModelWithProjection.from_pretrained(str(tiny_sd3_dir / c)).eval()
        for c in ("text_encoder", "text_encoder_2")
    }
    te = TextEncoderLoRA(types.SimpleNamespace(**encoders), "sd3", max_loras=2, max_rank=8)
    loras = [LoRARequest("d", 51, sd3_file), LoRARequest("k", 52, str(tmp_path / "kohya.safetensors"))]
    for lora in loras:
        te.read(lora.lora_path)
        te.note_loaded([lora])
        for name in te.users(lora):
            te.managers[name].add_lora(lora)
        te.done_loading()
    assert all(te.users(lora) == ["text_encoder", "text_encoder_2"] for lora in loras)
    ids = torch.randint(0, 99, (1, 6), generator=torch.Generator().manual_seed(1)).repeat(2, 1)
    with te.activate(
        [RequestAdapters.of(loras[0], 0.9), RequestAdapters.of(loras[1], 0.9)], [0, 1]
    ):  # row 0: diffusers file, row 1: kohya
        outs = {c: m(input_ids=ids).text_embeds for c, m in encoders.items()}
    for c, out in outs.items():
        assert (out[0] - out[1]).abs().max().item() <= 1e-5
        assert (out[0] - encoders[c](input_ids=ids[:1]).text_embeds[0]).abs().max().item() > 1e-3


def test_text_encoder_scale_in_the_http_field_and_its_one_rule_site():
    """HTTP ``text_encoder_scale`` (or ComfyUI's ``strength_clip``) reaches the request adapter; the value is
    checked in ``validate_request_adapters`` (a number, finite, within the scale limits, no schedule), and an
    LLM stage refuses it."""
    from vllm_omni.entrypoints.openai.lora import parse_lora_field
    from vllm_omni.errors import InvalidRequestError, OpenAIError
    from vllm_omni.lora.request import llm_stage_adapter, validate_request_adapters

    for key in ("text_encoder_scale", "strength_clip"):
        [spec] = parse_lora_field({"path": "/loras/a.safetensors", "scale": 0.5, key: 1.5})
        assert (spec.scale, spec.text_encoder_scale) == (0.5, 1.5)
    with pytest.raises(OpenAIError, match="spellings of the same field 'text_encoder_scale'"):
        parse_lora_field({"path": "/a", "text_encoder_scale": 1, "strength_clip": 1})
    lora = LoRARequest("a", 1, "/loras/a.safetensors")
    [ok] = validate_request_adapters([RequestAdapter(lora, 0.5, text_encoder_scale=2)], field="lora")
    assert ok.text_encoder_scale == 2.0 and isinstance(ok.text_encoder_scale, float)
    for bad, match in (
        (float("inf"), "finite"),
        ([1.0, 2.0], "no per-step"),
        ("1", "finite number"),
        (1e9, "finite"),
    ):
        with pytest.raises(InvalidRequestError, match=rf"lora\[0\]\.text_encoder_scale.*{match}"):
            validate_request_adapters([RequestAdapter(lora, 0.5, text_encoder_scale=bad)], field="lora")
    with pytest.raises(InvalidRequestError, match="text_encoder_scale"):
        llm_stage_adapter([RequestAdapter(lora, text_encoder_scale=1.0)], "stage 0")
