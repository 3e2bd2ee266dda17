"""lightx2v-style Wan distill files (``lora_down`` / ``lora_up`` / ``alpha`` with ``diff_b`` bias deltas and
``diff`` full deltas, ComfyUI names) read as diffusers' ``WanPipeline.load_lora_weights`` reads them.

The file (``tools/make_tiny_wan.write_lightx2v_style_lora``) carries every kind of delta: ``diff_b`` on the
attention and FFN projections and the output head plus ``head.head.diff`` (which diffusers keeps, as
``lora_B.bias`` and as LoRA factors), and norm / modulation deltas (which it drops). The distill backend
(fused at start-up) equals diffusers' ``load_lora_weights`` + ``fuse_lora`` on the tiny Wan2.1-style
single expert, float32; request-time LoRA refuses the file naming its ``diff_b`` keys.
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


def test_distill_fuses_bias_deltas_as_diffusers_fuse_lora(model_dir, lightx2v_file, tmp_path, caplog):
    from diffusers import WanPipeline as Reference

    from vllm_omni import Omni

    ref = Reference.from_pretrained(str(model_dir))
    ref.set_progress_bar_config(disable=True)

    def run():
        gen = [torch.Generator().manual_seed(SEED)]
        return ref(prompt=[PROMPT], num_frames=NUM_FRAMES, output_type="latent", generator=gen, **GEN).frames

    ref.load_lora_weights(lightx2v_file, adapter_name="distill")
    assert ref.transformer.blocks[0].attn1.to_q.lora_B["distill"].bias is not None  # diffusers kept diff_b
    ref.fuse_lora(components=["transformer"], lora_scale=1.0)
    want = run()
    ref.unfuse_lora()
    ref.unload_lora_weights()
    ref.load_lora_weights(_no_bias_copy(lightx2v_file, tmp_path / "no_bias.safetensors"))
    without_deltas = run()
    assert _err(want, without_deltas) > 0.02  # the deltas diffusers keeps matter
    caplog.set_level(logging.WARNING, logger="vllm_omni.diffusion.lora.formats.model_keys")
    with Omni(str(model_dir), lora_path=[lightx2v_file], lora_backend="distill", dtype="float32") as omni:
        [out] = omni.generate([PROMPT], _sp(), use_tqdm=False)
    got = torch.as_tensor(out.latents).float()
    assert _err(got, want) <= TOL
    dropped = [r.getMessage() for r in caplog.records if "are not applied" in r.getMessage()]
    # 2 blocks x (norm3.diff, norm3.diff_b, cross_attn.norm_q.diff, modulation.diff): diffusers drops them
    assert dropped and "8 of 30 .diff/.diff_b tensors" in dropped[0], caplog.text
    assert "blocks.0.modulation.diff" in dropped[0]


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
