"""lightx2v-style Wan distill files (``lora_down`` / ``lora_up`` / ``alpha`` with ``diff_b`` bias deltas and
``diff`` full deltas, ComfyUI names) read as diffusers' ``WanPipeline.load_lora_weights`` reads them.

The file (``tools/make_tiny_wan.write_lightx2v_style_lora``) carries every kind of delta: ``diff_b`` on the
attention and FFN projections and the output head plus ``head.head.diff`` (which diffusers keeps, as
``lora_B.bias`` and as LoRA factors), and norm / modulation deltas (which it drops). On the tiny
Wan2.1-style single expert, float32, final latents within 1e-4: the distill backend (fused at start-up)
equals diffusers' ``load_lora_weights`` + ``fuse_lora``, and request-time LoRA at scale 0.7 (the bias
delta added per row as ``lambda s b``) equals diffusers + peft with ``set_adapters(..., [0.7])``.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.diffusion.test_wan_moe_distill import GEN, NUM_FRAMES, PROMPT, SEED
from vllm_omni.errors import LoRAFormatError

pytestmark = [pytest.mark.slow]
TOL = 1e-4


def _err(a, b) -> float:
    return float((torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs().max())


@pytest.fixture(scope="module")
def model_dir():
    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan

    return ensure_tiny_wan(test_assets_root())


@pytest.fixture(scope="module")
def lightx2v_file(model_dir, tmp_path_factory) -> str:
    from tools.make_tiny_wan import write_lightx2v_style_lora

    out = tmp_path_factory.mktemp("lightx2v") / "wan_lightx2v_distill.safetensors"
    return os.fspath(write_lightx2v_style_lora(model_dir, "transformer", 40, out))


def _no_bias_copy(path: str, out) -> str:
    """The same file without its ``.diff`` / ``.diff_b`` tensors."""
    from safetensors.torch import load_file, save_file

    save_file({k: v for k, v in load_file(path).items() if not k.endswith((".diff", ".diff_b"))}, str(out))
    return str(out)


def test_distill_and_request_time_apply_the_deltas_as_diffusers(model_dir, lightx2v_file, tmp_path, caplog):
    from diffusers import WanPipeline as Reference

    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    ref = Reference.from_pretrained(str(model_dir))
    ref.set_progress_bar_config(disable=True)

    def run():
        gen = [torch.Generator().manual_seed(SEED)]
        return ref(prompt=[PROMPT], num_frames=NUM_FRAMES, output_type="latent", generator=gen, **GEN).frames

    ref.load_lora_weights(lightx2v_file, adapter_name="distill")
    assert ref.transformer.blocks[0].attn1.to_q.lora_B["distill"].bias is not None  # diffusers kept diff_b
    ref.set_adapters(["distill"], [0.7])
    want_runtime = run()  # peft: lambda * s * (B A x + b)
    ref.set_adapters(["distill"], [1.0])
    ref.fuse_lora(components=["transformer"], lora_scale=1.0)
    want_fused = run()
    ref.unfuse_lora()
    ref.unload_lora_weights()
    ref.load_lora_weights(_no_bias_copy(lightx2v_file, tmp_path / "no_bias.safetensors"))
    assert _err(want_fused, run()) > 0.02  # the deltas diffusers keeps matter
    caplog.set_level(logging.WARNING, logger="vllm_omni.diffusion.lora.formats.model_keys")
    with Omni(str(model_dir), lora_path=[lightx2v_file], lora_backend="distill", dtype="float32") as omni:
        [fused] = omni.generate([PROMPT], _sp(), use_tqdm=False)
    assert _err(fused.latents, want_fused) <= TOL
    dropped = [r.getMessage() for r in caplog.records if "are not applied" in r.getMessage()]
    # 2 blocks x (norm3.diff, norm3.diff_b, cross_attn.norm_q.diff, modulation.diff): diffusers drops them
    assert dropped and "8 of 30 .diff/.diff_b tensors" in dropped[0], caplog.text
    assert "blocks.0.modulation.diff" in dropped[0]
    request = LoRARequest("lightx2v", 1, lightx2v_file)
    with Omni(str(model_dir), dtype="float32", enable_progress_bar=False) as omni:  # eager, request-time
        [runtime] = omni.generate([PROMPT], _sp(), use_tqdm=False, lora_requests=[request], lora_scales=[0.7])
    assert _err(runtime.latents, want_runtime) <= TOL


def _sp():
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return OmniDiffusionSamplingParams(
        seed=SEED, output_type="latent", extra_args={"num_frames": NUM_FRAMES}, **GEN
    )


def test_other_model_families_refuse_the_deltas_naming_the_keys(lightx2v_file):
    """Only diffusers' Wan converter reads ``.diff`` / ``.diff_b``: bound to any other denoiser the file is
    refused with the keys named (request-time refusal on Wan: ``test_wan_in_tree_pipeline``)."""
    from vllm_omni.diffusion.lora.formats.model_keys import prepare_adapter_for_model
    from vllm_omni.diffusion.lora.loading import load_lora_adapter

    adapter = load_lora_adapter(lightx2v_file)
    assert len(adapter.deltas) == 30 and not any(".diff" in k for k in adapter.modules)
    with pytest.raises(LoRAFormatError, match=r"Wan models only.*blocks\.0\.cross_attn\.k\.diff_b"):
        prepare_adapter_for_model(adapter, [torch.nn.Linear(2, 2)], [], lambda key: False)


def test_compiled_banks_refuse_a_bias_delta():
    """Fixed-shape banks (compiled stages) hold ``A`` / ``B`` only: a slot with a bias delta is refused
    with the way out named (the manager turns this into a load error naming the file and the layer)."""
    from vllm_omni.diffusion.lora.banks import LoRABank
    from vllm_omni.diffusion.lora.geometry import LayerGeometry, OutputSlice
    from vllm_omni.diffusion.lora.weights import SlotWeights

    geometry = LayerGeometry("linear", 4, 4, 0, 4, 4, (OutputSlice(0, 4, 0, 4, 0),), {})
    bank = LoRABank(geometry, 2, 4, torch.zeros(1, 2, 2), torch.device("cpu"), torch.float32)
    plain = SlotWeights(torch.ones(2, 4), ((0, 2, 0, 4),), (torch.ones(2, 4),), (2,))
    assert bank.check(plain) is None
    biased = SlotWeights(plain.a, plain.parts, plain.bt, plain.ranks, bias=torch.ones(4))
    assert "enforce_eager=True" in bank.check(biased) and "diff_b" in bank.check(biased)
