"""Adapters handed over in memory on a diffusion stage (issue 40): a ``TensorLoRARequest`` (peft config
dict + state dict) serves exactly the tensors of each update, compared with diffusers+peft loading the
same tensors (``load_lora_adapter``); bad tensors are refused at ``add_lora`` naming the key and the
previous version keeps serving; under ``worker_backend="mp"`` the tensors cross without a file, and the
merged fast path (``lora_merge=True``) serves them within float32 rounding of the reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lora_oracle import reference_latents
from safetensors.torch import load_file

from vllm_omni.errors import InvalidAdapterError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import TensorLoRARequest

TOL = 1e-4
KW = dict(seed=5, steps=2, guidance=3.0, height=32, width=32)
PROMPT = "a red cat on a mat"


def _params() -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(
        height=32, width=32, num_inference_steps=2, guidance_scale=3.0, seed=5, output_type="latent"
    )


def _adapter(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A trainer's hand-over: the config dict and the state dict (``get_peft_model_state_dict`` keys)."""
    return json.loads((folder / "adapter_config.json").read_text()), load_file(
        str(folder / "adapter_model.safetensors")
    )


@pytest.fixture(scope="module")
def reference(tiny_z_image_dir):
    """``latents(config, tensors)``: diffusers+peft on one pipeline, the adapter loaded from the tensors."""
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(tiny_z_image_dir))
    pipe.set_progress_bar_config(disable=True)
    count = iter(range(1000))

    def latents(config: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        name = f"s{next(count)}"
        state = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
        meta = {k: config[k] for k in ("r", "lora_alpha", "target_modules", "use_rslora") if k in config}
        pipe.transformer.load_lora_adapter(state, prefix=None, adapter_name=name, metadata=meta)
        pipe.transformer.set_adapters([name], [1.0])
        try:
            return reference_latents(pipe, PROMPT, **KW)
        finally:
            pipe.transformer.delete_adapters(name)

    return latents


@pytest.fixture(scope="module")
def omni(tiny_z_image_dir):
    from vllm_omni import Omni

    engine = Omni(model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False, max_loras=2)
    yield engine
    engine.shutdown()


def test_each_update_serves_that_steps_tensors(omni, tiny_z_image_loras, reference, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config, tensors = _adapter(Path(tiny_z_image_loras["attn"]))
    outputs = []
    for step, factor in enumerate((1.0, -0.6, 1.7)):  # three "optimizer steps": new B, same A
        trained = {k: v * factor if "lora_B" in k else v.clone() for k, v in tensors.items()}
        lora = TensorLoRARequest(lora_name="policy", lora_int_id=11, peft_config=config, lora_tensors=trained)
        expected = reference(config, trained)
        if step == 1:
            assert omni.add_lora(lora)
        for t in trained.values():
            t.zero_()  # the trainer's in-place update after the hand-over changes nothing
        got = omni.generate(PROMPT, _params(), lora_request=lora)[0].latents
        assert (got - expected).abs().max() <= TOL, f"step {step}"
        outputs.append(got)
    assert (outputs[0] - outputs[1]).abs().max() > 50 * TOL
    assert list(tmp_path.iterdir()) == []


def test_bad_tensors_are_refused_naming_the_key(omni, tiny_z_image_loras, reference):
    config, tensors = _adapter(Path(tiny_z_image_loras["ff"]))
    good = TensorLoRARequest(lora_name="bad", lora_int_id=12, peft_config=config, lora_tensors=tensors)
    assert omni.add_lora(good)
    expected = omni.generate(PROMPT, _params(), lora_request=good)[0].latents
    assert (expected - reference(config, tensors)).abs().max() <= TOL
    key = sorted(k for k in tensors if "lora_A" in k)[0]
    module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
    cases = [
        ({**tensors, key: tensors[key].clone().fill_(math.inf)}, config, "NaN or inf"),
        ({**tensors, key: torch.zeros(tensors[key].shape[0], 3)}, config, module),
        (tensors, {**config, "r": 2}, "rank"),
    ]
    for bad, cfg, needle in cases:
        with pytest.raises(InvalidAdapterError, match=needle):
            omni.add_lora(
                TensorLoRARequest(lora_name="bad", lora_int_id=12, peft_config=cfg, lora_tensors=bad)
            )
        assert torch.equal(omni.generate(PROMPT, _params(), lora_request=good)[0].latents, expected)
    assert omni.adapter_registry.get("bad").version == 1


def test_mp_worker_gets_the_tensors_without_a_file_and_serves_them_merged(
    tiny_z_image_dir, tiny_z_image_loras, reference, tmp_path
):
    from vllm_omni import Omni

    config, tensors = _adapter(Path(tiny_z_image_loras["qv"]))
    lora = TensorLoRARequest(lora_name="qv", lora_int_id=13, peft_config=config, lora_tensors=tensors)
    engine = Omni(
        model=str(tiny_z_image_dir),
        dtype="float32",
        enable_progress_bar=False,
        worker_backend="mp",
        lora_merge=True,
    )
    try:
        assert engine.add_lora(lora)
        got = engine.generate(PROMPT, _params(), lora_request=lora)[0].latents
    finally:
        engine.shutdown()
    assert (got - reference(config, tensors)).abs().max() <= TOL
