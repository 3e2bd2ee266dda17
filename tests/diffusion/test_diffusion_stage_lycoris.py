"""LoHa / LoKr adapters through ``Omni`` on the tiny Z-Image, against diffusers + peft on the same weights.

The reference is diffusers' ``ZImagePipeline`` whose transformer carries peft's own update of each adapter
(``PeftModel.from_pretrained`` + ``set_scale`` + ``merge_and_unload``, summed); final latents, fp32,
max abs error <= 1e-4. LyCORIS single files are the same weights rewritten by ``tools.lora_layouts``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from lora_oracle import merged_reference_pipeline, reference_latents

from tools.lora_layouts import write_lycoris
from tools.make_tiny_diffusion_lora import build_lycoris_adapter
from vllm_omni.errors import LoRAFormatError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest

TOL = 1e-4
KW = dict(seed=3, steps=2, guidance=3.0, height=32, width=32)
PROMPT = "a green teapot"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]


def params(**overrides) -> OmniDiffusionSamplingParams:
    base = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.0, seed=3, output_type="latent")
    base.update(overrides)
    return OmniDiffusionSamplingParams(**base)


@pytest.fixture(scope="module")
def lyco(tiny_z_image_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("z_lycoris")
    folder = tiny_z_image_dir / "transformer"
    loha = build_lycoris_adapter(folder, root / "loha", "loha", 201, TARGETS, r=4, alpha=6.0)
    lokr = build_lycoris_adapter(
        folder, root / "lokr", "lokr", 202, TARGETS, r=2, alpha=3.0, decompose_both=True, decompose_factor=4
    )
    return {
        "loha": str(loha),
        "lokr": str(lokr),
        "loha_file": write_lycoris(str(loha), str(root / "loha.safetensors")),
        "lokr_file": write_lycoris(str(lokr), str(root / "lokr.safetensors")),
    }


@pytest.fixture(scope="module")
def reqs(lyco, tiny_z_image_loras):
    return {
        "loha": LoRARequest("loha", 1, lyco["loha"]),
        "lokr_file": LoRARequest("lokr_file", 2, lyco["lokr_file"]),
        "loha_file": LoRARequest("loha_file", 3, lyco["loha_file"]),
        "attn": LoRARequest("attn", 4, str(tiny_z_image_loras["attn"])),
    }


@pytest.fixture(scope="module")
def oracle(tiny_z_image_dir):
    cache: dict = {}

    def run(adapters=(), prompt=PROMPT):
        key = (tuple((str(p), s) for p, s in adapters), prompt)
        if key not in cache:
            pipe = merged_reference_pipeline(tiny_z_image_dir, list(adapters))
            cache[key] = reference_latents(pipe, prompt, **KW)
        return cache[key]

    return run


@pytest.fixture(scope="module")
def omni(tiny_z_image_dir):
    from vllm_omni import Omni

    engine = Omni(
        model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False, max_loras=3, max_cpu_loras=4
    )
    yield engine
    engine.shutdown()


def _err(a, b) -> float:
    return (a - b).abs().max().item()


def _latents(omni, prompt=PROMPT, **kw):
    return omni.generate(prompt=prompt, sampling_params=params(), **kw)[0].latents


@pytest.mark.parametrize(
    ("names", "scales", "peft_dirs"),
    [
        (["loha"], [0.8], ["loha"]),
        (["loha_file"], [0.8], ["loha"]),
        (["lokr_file"], [1.2], ["lokr"]),
        (["loha", "lokr_file", "attn"], [0.7, -0.5, 0.6], ["loha", "lokr", "attn"]),
    ],
    ids=["loha-peft", "loha-lycoris-file", "lokr-lycoris-file", "loha+lokr+lora"],
)
def test_matches_diffusers_peft(omni, reqs, lyco, oracle, tiny_z_image_loras, names, scales, peft_dirs):
    got = _latents(omni, lora_requests=[reqs[n] for n in names], lora_scales=scales)
    paths = [lyco.get(d) or str(tiny_z_image_loras[d]) for d in peft_dirs]
    expected = oracle(list(zip(paths, scales)))
    err, effect = _err(got, expected), _err(expected, oracle())
    print(f"{names} {scales}: max abs err {err:.2e} (adapter effect {effect:.3f})", file=sys.stderr)
    assert err <= TOL and effect > 50 * TOL


def test_mixed_batch_equals_solo_runs(omni, reqs, lyco, oracle, tiny_z_image_loras):
    prompts = ["a green teapot", "a yellow kite", "a green teapot"]
    sets = [[reqs["loha"]], [reqs["lokr_file"], reqs["attn"]], []]
    scales = [[1.0], [0.5, 1.0], []]
    stage = omni._orchestrator.runtimes[0]
    before = len(stage.batch_sizes)
    outs = omni.generate(prompts, params(), lora_requests=sets, lora_scales=scales)
    assert stage.batch_sizes[before:] == [3], "the three requests must share one denoiser batch"
    refs = [
        oracle([(lyco["loha"], 1.0)], prompt=prompts[0]),
        oracle([(lyco["lokr"], 0.5), (str(tiny_z_image_loras["attn"]), 1.0)], prompt=prompts[1]),
        oracle(prompt=prompts[2]),
    ]
    for out, ref in zip(outs, refs, strict=True):
        assert _err(out.latents, ref) <= TOL


def test_refused_file_changes_nothing(omni, lyco, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(lyco["loha_file"])
    key = next(k for k in sorted(tensors) if k.endswith(".hada_w1_a"))
    tensors[key.replace("hada_w1_a", "hada_t1")] = torch.ones(4, 4, 3, 3)
    bad = str(tmp_path / "tucker.safetensors")
    save_file(tensors, bad)
    before = omni.list_loras()
    with pytest.raises(LoRAFormatError, match=r"tucker\.safetensors.*hada_t1.*Tucker"):
        _latents(omni, lora_request=LoRARequest("tucker", 9, bad))
    assert omni.list_loras() == before


def test_distill_backend_fuses_lokr_file(tiny_z_image_dir, lyco, oracle):
    from vllm_omni import Omni

    with Omni(
        model=str(tiny_z_image_dir),
        dtype="float32",
        enable_progress_bar=False,
        lora_backend="distill",
        lora_path=lyco["lokr_file"],
        lora_scale=0.9,
    ) as omni:
        got = _latents(omni)
    assert _err(got, oracle([(lyco["lokr"], 0.9)])) <= TOL


def test_async_omni_serves_loha_and_lokr(tiny_z_image_dir, reqs, lyco, oracle):
    import asyncio

    from vllm_omni import AsyncOmni

    async def main(omni):
        async def one(**kw):
            return [out async for out in omni.generate(PROMPT, params(), **kw)][0]

        assert await omni.add_lora(reqs["loha"])
        assert await omni.pin_lora(reqs["loha"].lora_int_id)
        alone, composed = await asyncio.gather(
            one(lora_request=reqs["lokr_file"], lora_scale=1.2),
            one(lora_requests=[reqs["loha"], reqs["attn"]], lora_scales=[0.8, 0.5]),
        )
        assert await omni.remove_lora(reqs["loha"].lora_int_id)
        return alone, composed

    omni = AsyncOmni(model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False, max_loras=3)
    try:
        alone, composed = asyncio.run(main(omni))
    finally:
        omni.shutdown()
    assert _err(alone.latents, oracle([(lyco["lokr"], 1.2)])) <= TOL
    attn = reqs["attn"].lora_path
    assert _err(composed.latents, oracle([(lyco["loha"], 0.8), (attn, 0.5)])) <= TOL
