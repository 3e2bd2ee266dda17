"""A name is a version on a diffusion stage (issue 21, rule 1): the host cache and the slots are keyed by
adapter id, so an adapter whose files were rewritten must reach them under a new id; before the
registry, a request naming the rewritten adapter (and ``add_lora`` of it, as HTTP ``load_inplace``
does) was served the cached old weights. Latents are compared with diffusers+peft on the files on disk.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lora_oracle import reference_latents, reference_pipeline

from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest

TOL = 1e-4
KW = dict(seed=5, steps=2, guidance=3.0, height=32, width=32)
PROMPT = "a red cat on a mat"


def _params() -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(
        height=32, width=32, num_inference_steps=2, guidance_scale=3.0, seed=5, output_type="latent"
    )


def _copy_over(src: Path, dst: Path) -> None:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(src / name, dst / name)


@pytest.fixture(scope="module")
def omni(tiny_z_image_dir):
    from vllm_omni import Omni

    engine = Omni(model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False, max_loras=2)
    yield engine
    engine.shutdown()


def test_rewritten_files_reach_the_host_cache_as_a_new_version(
    omni, tiny_z_image_dir, tiny_z_image_loras, tmp_path
):
    attn, ff = Path(tiny_z_image_loras["attn"]), Path(tiny_z_image_loras["ff"])
    ref = {
        n: reference_latents(reference_pipeline(tiny_z_image_dir, [(p, 1.0)]), PROMPT, **KW)
        for n, p in (("attn", attn), ("ff", ff))
    }
    assert (ref["attn"] - ref["ff"]).abs().max() > 50 * TOL
    path = tmp_path / "d"
    shutil.copytree(attn, path)
    lora = LoRARequest("d", 1, str(path))

    def run():
        return omni.generate(PROMPT, _params(), lora_request=lora)[0].latents

    assert (run() - ref["attn"]).abs().max() <= TOL
    _copy_over(ff, path)  # a request after a rewrite gets the new files, not the cached entry of id 1
    assert (run() - ref["ff"]).abs().max() <= TOL
    # registered, rewritten, then reloaded (HTTP load_inplace): the new weights, one entry in the cache
    assert omni.add_lora(lora)
    _copy_over(attn, path)
    assert omni.add_lora(lora, reload=True) is True
    assert (run() - ref["attn"]).abs().max() <= TOL
    engine_id = omni.adapter_registry.get("d").engine.lora_int_id
    assert engine_id in omni._orchestrator.runtimes[0].list_loras() and omni.list_loras() >= {1}
    # remove + add after a rewrite: the same
    assert omni.remove_lora(1) and 1 not in omni.list_loras()
    _copy_over(ff, path)
    assert omni.add_lora(lora)
    assert (run() - ref["ff"]).abs().max() <= TOL
