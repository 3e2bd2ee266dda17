"""Fixtures for the diffusion runtime tests: tiny Z-Image / SD3 directories and shared engines."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `tools/` lives in the checkout, not in the package
    sys.path.insert(0, str(REPO_ROOT))


def _assets_root() -> Path:
    return Path(os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO_ROOT / ".cache" / "test_assets")


@pytest.fixture(scope="session")
def tiny_diffusion_assets() -> dict[str, Path]:
    """``{"z_image": Path, "sd3": Path}``: tiny diffusers directories, built once (file-locked)."""
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return ensure_tiny_diffusion_assets(_assets_root())


@pytest.fixture(scope="session")
def tiny_z_image_dir(tiny_diffusion_assets) -> Path:
    return tiny_diffusion_assets["z_image"]


@pytest.fixture(scope="session")
def tiny_sd3_dir(tiny_diffusion_assets) -> Path:
    return tiny_diffusion_assets["sd3"]


@pytest.fixture(scope="session")
def z_image_engine(tiny_z_image_dir):
    """In-process (TP=1) fp32 CPU engine on the tiny Z-Image directory, shared by the session."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    engine = DiffusionEngine(
        OmniDiffusionConfig(
            model=str(tiny_z_image_dir), dtype="float32", device="cpu", enable_progress_bar=False
        )
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def diffusers_z_image(tiny_z_image_dir):
    """diffusers' own ``ZImagePipeline`` on the same directory (reference implementation)."""
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(tiny_z_image_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def tiny_z_image_loras(tiny_z_image_dir) -> dict[str, Path]:
    """PEFT adapters for the tiny Z-Image transformer (``attn``, ``qv``, ``ff``) and ``attn_file``
    (single .safetensors); see ``tools/make_tiny_diffusion_lora.py``."""
    from tools.make_tiny_diffusion_lora import ensure_tiny_z_image_loras

    return ensure_tiny_z_image_loras(tiny_z_image_dir, _assets_root())


@pytest.fixture(scope="session")
def tiny_qwen_image_dir() -> Path:
    """Tiny diffusers ``QwenImagePipeline`` directory (see ``tools/make_tiny_qwen_image.py``)."""
    from tools.make_tiny_qwen_image import ensure_tiny_qwen_image

    return ensure_tiny_qwen_image(_assets_root())


@pytest.fixture(scope="session")
def tiny_qwen_image_loras(tiny_qwen_image_dir) -> dict[str, Path]:
    """Adapters for the tiny Qwen-Image transformer: PEFT folders ``attn`` / ``mlp`` and ``attn`` as
    diffusers, kohya (musubi) and ComfyUI files (see ``tools/make_tiny_qwen_image.py``)."""
    from tools.make_tiny_qwen_image import ensure_tiny_qwen_image_loras

    return ensure_tiny_qwen_image_loras(tiny_qwen_image_dir, _assets_root())


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_dir() -> Path:
    """Tiny diffusers ``QwenImageEditPipeline`` directory (the same weights plus a Qwen2-VL processor)."""
    from tools.make_tiny_qwen_image import ensure_tiny_qwen_image

    return ensure_tiny_qwen_image(_assets_root(), edit=True)
