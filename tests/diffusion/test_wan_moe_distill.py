"""The spec's two-denoiser distill case end to end: a tiny Wan2.2-style MoE directory
(``transformer`` + ``transformer_2``, ``boundary_ratio`` 0.5) with one LoRA file per denoiser.

``Omni(model, lora_path=[high, low], lora_backend="distill")`` fuses the high-noise file into
``transformer`` and the low-noise file into ``transformer_2`` at start-up. The reference is
diffusers' ``WanPipeline`` loading the same two files (``load_lora_weights`` and, for the
second, ``load_into_transformer_2=True``) on the same directory and seed; final latents are
compared in fp32.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import test_assets_root
from tests.diffusion.lora_oracle import save_random_diffusers_lora
from vllm_omni.errors import ConfigError, LoRAFormatError

PROMPT = "a red cat running on a mat"
GEN = {"height": 32, "width": 48, "num_inference_steps": 4, "guidance_scale": 3.0}
NUM_FRAMES = 5
SEED = 5
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj"]

pytestmark = [pytest.mark.slow]


def _write_adapter(model_dir: Path, subfolder: str, seed: int, out: Path) -> Path:
    """A PEFT LoRA for one Wan denoiser, saved the way diffusers saves Wan LoRAs
    (``WanPipeline.save_lora_weights``: keys ``transformer.blocks.N....lora_A.weight``)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(model_dir, subfolder=subfolder)
    return save_random_diffusers_lora(model, WanPipeline, TARGETS, seed, out)


@pytest.fixture(scope="module")
def wan_moe_dir() -> Path:
    from tools.make_tiny_wan import ensure_tiny_wan

    return ensure_tiny_wan(test_assets_root(), moe=True)


@pytest.fixture(scope="module")
def moe_loras(wan_moe_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("wan_moe_loras")
    high = _write_adapter(wan_moe_dir, "transformer", 10, root / "high")
    low = _write_adapter(wan_moe_dir, "transformer_2", 11, root / "low")
    return high, low


def _diffusers_latents(model_dir: Path, high: Path | None = None, low: Path | None = None) -> torch.Tensor:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    if high is not None:
        pipe.load_lora_weights(str(high), adapter_name="high")
    if low is not None:
        pipe.load_lora_weights(str(low), adapter_name="low", load_into_transformer_2=True)
    out = pipe(
        prompt=[PROMPT],
        num_frames=NUM_FRAMES,
        output_type="latent",
        generator=[torch.Generator().manual_seed(SEED)],
        **GEN,
    )
    return out.frames.float()


@pytest.fixture(scope="module")
def reference(wan_moe_dir, moe_loras) -> dict[str, torch.Tensor]:
    high, low = moe_loras
    return {"base": _diffusers_latents(wan_moe_dir), "lora": _diffusers_latents(wan_moe_dir, high, low)}


def _omni_latents(model_dir: Path, lora_path: list[str]) -> torch.Tensor:
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    omni = Omni(str(model_dir), lora_path=lora_path, lora_backend="distill", dtype="float32")
    try:
        sp = OmniDiffusionSamplingParams(
            seed=SEED, output_type="latent", extra_args={"num_frames": NUM_FRAMES}, **GEN
        )
        [out] = omni.generate([PROMPT], sp)
    finally:
        omni.shutdown()
    return torch.as_tensor(out.latents).float()


def test_two_files_fuse_into_the_two_denoisers_like_diffusers(wan_moe_dir, moe_loras, reference):
    high, low = moe_loras
    got = _omni_latents(wan_moe_dir, [os.fspath(high), os.fspath(low)])
    assert got.shape == reference["lora"].shape == (1, 16, 2, 4, 6)
    # the adapters matter on this model: the fused result is far from the base model's
    assert (reference["lora"] - reference["base"]).abs().max().item() > 0.05
    assert (got - reference["lora"]).abs().max().item() <= 1e-4


def test_file_order_is_denoiser_order(wan_moe_dir, moe_loras, reference):
    """The first file goes to ``transformer`` (high noise), the second to ``transformer_2``:
    swapping them gives another result, so the mapping is by position, not by luck."""
    high, low = moe_loras
    swapped = _omni_latents(wan_moe_dir, [os.fspath(low), os.fspath(high)])
    assert (swapped - reference["lora"]).abs().max().item() > 1e-2


def test_more_files_than_denoisers_is_a_config_error(wan_moe_dir, moe_loras):
    from vllm_omni import Omni

    high, low = moe_loras
    with pytest.raises(ConfigError, match=r"3 LoRA files for 2 denoiser\(s\)"):
        Omni(str(wan_moe_dir), lora_path=[str(high), str(low), str(high)], lora_backend="distill")


def test_file_matching_no_denoiser_module_is_refused(wan_moe_dir, moe_loras, tmp_path):
    """A file whose keys name modules neither Wan transformer has fails at start, naming the file."""
    from safetensors.torch import load_file, save_file

    from vllm_omni import Omni

    high, low = moe_loras
    foreign = {
        k.replace("transformer.blocks.", "transformer.single_transformer_blocks."): v
        for k, v in load_file(str(high)).items()
    }
    bad = tmp_path / "foreign.safetensors"
    save_file(foreign, str(bad))
    with pytest.raises(LoRAFormatError) as info:
        Omni(str(wan_moe_dir), lora_path=[str(high), str(bad)], lora_backend="distill")
    message = str(info.value)
    assert message.startswith("Stage 0 (diffusion)")
    assert "LoRA file 1 of 2 (fused into 'transformer_2')" in message
    assert "foreign.safetensors: none of its modules match" in message
