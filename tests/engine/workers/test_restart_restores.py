"""A worker restart restores what it can (issue 21 rule 4), on ``mp`` and ``ray``.

A diffusion stage holds two run-time adapters; the files of one are deleted and the worker is
killed with SIGKILL. The restart brings the stage back with the other adapter (same latents as
before the kill), lists the lost one with its error, and refuses requests naming it with an
``AdapterRestoreError`` (an adapter error: HTTP 400) naming its path. Once its files are back
and it is added again, it serves the same latents as before.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from vllm_omni.errors import AdapterRestoreError, InvalidAdapterError, StageDeadError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPT = "a lighthouse at dusk"
PARAMS = OmniDiffusionSamplingParams(
    height=32, width=32, num_inference_steps=2, guidance_scale=2.0, seed=9, output_type="latent"
)


@pytest.fixture(scope="module")
def assets():
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets
    from tools.make_tiny_diffusion_lora import ensure_tiny_z_image_loras

    z_image = ensure_tiny_diffusion_assets(test_assets_root())["z_image"]
    return z_image, ensure_tiny_z_image_loras(z_image, test_assets_root())


def _latents(omni, lora=None):
    return omni.generate(PROMPT, PARAMS, lora_request=lora)[0].latents


def _wait_ready(omni, timeout: float = 900.0) -> None:
    start = time.monotonic()
    while omni.stage_health()[0] != "ready":
        assert time.monotonic() - start < timeout, f"stage 0 did not come back: {omni.stage_health()}"
        time.sleep(0.5)


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_restart_restores_the_other_adapters_and_marks_the_lost_one(backend, assets, tmp_path):
    from vllm_omni import Omni
    from vllm_omni.entrypoints.openai.errors import engine_error_to_openai

    z_image, loras = assets
    path_a, path_b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(loras["attn"], path_a)
    shutil.copytree(loras["qv"], path_b)
    a, b = LoRARequest("a", 1, str(path_a)), LoRARequest("b", 2, str(path_b))
    with Omni(
        model=str(z_image),
        dtype="float32",
        enable_progress_bar=False,
        worker_backend=backend,
        max_loras=2,
        stage_0_restart_backoff_s=0.1,
    ) as omni:
        runtime = omni._orchestrator.runtimes[0]
        assert omni.add_lora(a) and omni.add_lora(b) and omni.pin_lora(2)
        plain, with_a, with_b = _latents(omni), _latents(omni, a), _latents(omni, b)
        assert (with_a - plain).abs().max() > 1e-4 and (with_b - plain).abs().max() > 1e-4

        shutil.rmtree(path_a)
        pid = runtime.pid if backend == "mp" else runtime.info["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(StageDeadError, match=r"Stage 0 \(diffusion\)"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # mp sees the death on its own; ray at the next call
                _latents(omni)
                time.sleep(0.2)
        _wait_ready(omni)
        assert runtime.restarts == 1

        # the stage serves, with the adapter that could be restored, pinned as before
        assert omni.list_loras() == {2}
        assert _latents(omni, b).equal(with_b) and _latents(omni).equal(plain)
        failed = omni.failed_loras()
        assert list(failed) == [0] and list(failed[0]) == [1]
        # the registry owns it: the lost adapter's record is failed, the restored one pinned as before
        assert omni.adapter_registry.get("a").stages[0].state == "failed"
        assert omni.adapter_registry.get("b").stages[0].state == "pinned"
        assert (
            "(id 1)" in failed[0][1] and str(path_a) in failed[0][1]
        )  # the stage's name may carry a version
        with pytest.raises(AdapterRestoreError, match=str(path_a)) as refused:
            _latents(omni, a)
        assert isinstance(refused.value, InvalidAdapterError)
        assert engine_error_to_openai(refused.value).status == 400

        # its files are back: added again, it serves what it served before
        shutil.copytree(loras["attn"], path_a)
        omni.remove_lora(1)
        assert omni.add_lora(a)
        assert omni.failed_loras() == {} and omni.adapter_registry.get("a").stages[0].state == "loaded"
        assert _latents(omni, a).equal(with_a)
