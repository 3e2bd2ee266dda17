"""Fixtures of the docs tests: the placeholder tree ``/path/to/<name>`` points into."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `tools/` lives in the checkout, not in the package
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def docs_assets_root(tiny_llm_assets, tiny_omni_assets, tmp_path_factory) -> Path:
    """A folder holding every name of ``doc_blocks.PLACEHOLDERS`` (tiny models, tiny adapters)."""
    from doc_blocks import build_assets

    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets
    from tools.make_tiny_diffusion_lora import ensure_tiny_z_image_loras
    from tools.make_tiny_flux import ensure_tiny_flux, ensure_tiny_flux_loras
    from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets
    from tools.make_tiny_qwen_image import ensure_tiny_qwen_image, ensure_tiny_qwen_image_loras
    from tools.make_tiny_wan import ensure_tiny_wan, ensure_tiny_wan_loras

    root = Path(os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO_ROOT / ".cache" / "test_assets")
    z_image = ensure_tiny_diffusion_assets(root)["z_image"]
    z_loras = ensure_tiny_z_image_loras(z_image, root)
    qwen_image = ensure_tiny_qwen_image(root)
    qwen_loras = ensure_tiny_qwen_image_loras(qwen_image, root)
    wan_loras = ensure_tiny_wan_loras(root)
    flux = ensure_tiny_flux(root, "dev")
    flux_loras = ensure_tiny_flux_loras(flux, root)
    qwen3_omni = ensure_tiny_qwen3_omni_assets(root)
    assets = {
        "llm_model": tiny_llm_assets.model_dir,
        "llm_adapter_a": tiny_llm_assets.adapter_a,
        "llm_adapter_b": tiny_llm_assets.adapter_b,
        "z_image": z_image,
        "z_attn": z_loras["attn"],
        "z_ff": z_loras["ff"],
        "z_attn_file": z_loras["attn_file"],
        "qwen_image": qwen_image,
        "qwen_image_edit": ensure_tiny_qwen_image(root, edit=True),
        "qwen_image_kohya": qwen_loras["attn_kohya"],
        "qwen_image_mlp": qwen_loras["mlp"],
        "flux_dev": flux,
        "flux_kohya": flux_loras["kohya"],
        "flux_mlp": flux_loras["mlp"],
        "wan_moe": ensure_tiny_wan(root, moe=True),
        "wan_ti2v": ensure_tiny_wan(root, ti2v=True),
        "wan_high": wan_loras["high"],
        "wan_low": wan_loras["low"],
        "omni_model": tiny_omni_assets.model_dir,
        "omni_thinker_adapter": tiny_omni_assets.thinker_adapter,
        "qwen3_omni_model": qwen3_omni.model_dir,
        "qwen3_omni_thinker_adapter": qwen3_omni.thinker_adapter,
        "qwen3_omni_talker_adapter": qwen3_omni.talker_adapter,
    }
    return build_assets(tmp_path_factory.mktemp("docs_assets"), assets)
