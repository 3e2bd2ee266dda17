"""Distill backend: fusing a single-file LoRA equals peft's merge_and_unload on the same weights."""

from __future__ import annotations

import copy
import json
import types

import pytest
import torch
from lora_toy_models import inputs, make_torch_dit, make_vllm_dit, process_weights, save_peft_adapter
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from vllm_omni.diffusion.lora import fuse_lora_files_into_pipeline, fuse_lora_into_model
from vllm_omni.errors import LoRAFormatError


def _export(peft_model, path: str, *, prefix: str, metadata: dict | None, alpha: float | None = None) -> str:
    """Write the adapter as one diffusers-style file: ``<prefix><module>.lora_A.weight`` (+ alphas)."""
    tensors = {}
    for key, value in get_peft_model_state_dict(peft_model).items():
        module_key = key.removeprefix("base_model.model.")
        tensors[prefix + module_key] = value.contiguous()
        if alpha is not None and ".lora_A." in key:
            tensors[prefix + module_key.split(".lora_A.")[0] + ".alpha"] = torch.tensor(alpha)
    header = {"format": "pt"}
    if metadata is not None:
        header["lora_adapter_metadata"] = json.dumps(metadata)
    save_file(tensors, path, metadata=header)
    return path


def _merged(peft_model, scale: float):
    model = copy.deepcopy(peft_model)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.set_scale("default", scale)
    return model.merge_and_unload().eval()


def _fused_weight_error(vllm_model, merged) -> float:
    worst = 0.0
    for i, block in enumerate(vllm_model.blocks):
        ref = merged.blocks[i]
        pairs = [
            (
                block.attn.to_qkv.weight,
                torch.cat([ref.attn.to_q.weight, ref.attn.to_k.weight, ref.attn.to_v.weight]),
            ),
            (block.ff.w13.weight, torch.cat([ref.ff.w1.weight, ref.ff.w3.weight])),
            (block.attn.to_out[0].weight, ref.attn.to_out[0].weight),
            (block.ff.w2.weight, ref.ff.w2.weight),
            (block.adaLN.weight, ref.adaLN.weight),
        ]
        worst = max(worst, *((a - b).abs().max().item() for a, b in pairs))
    return worst


@pytest.mark.parametrize(
    "scale, source",
    [(1.0, "metadata"), (0.5, "alpha_keys"), (-1.5, "metadata")],
)
@torch.no_grad()
def test_fuse_equals_peft_merge_and_unload(toy_base, adapters, tmp_path, scale, source):
    peft_model = adapters["b"][1]  # r=8, lora_alpha=4 -> s = 0.5
    if source == "metadata":
        meta = {"transformer.r": 8, "transformer.lora_alpha": 4.0, "transformer.use_rslora": False}
        path = _export(peft_model, str(tmp_path / "b.safetensors"), prefix="transformer.", metadata=meta)
    else:
        path = _export(
            peft_model, str(tmp_path / "b.safetensors"), prefix="diffusion_model.", metadata=None, alpha=4.0
        )
    merged = _merged(peft_model, scale)
    model = make_vllm_dit(toy_base.state_dict(), process=False)
    fused = fuse_lora_into_model(model, path, scale=scale)
    assert len(fused) == 10
    werr = _fused_weight_error(model, merged)
    process_weights(model)
    x, c = inputs(batch=2)
    oerr = (model(x, c) - merged(x, c)).abs().max().item()
    print(f"fuse scale={scale} ({source}): weight err {werr:.3g}, output err {oerr:.3g}")
    assert werr <= 1e-6 and oerr <= 1e-5
    assert (merged(x, c) - toy_base(x, c)).abs().max().item() > 1e-2


@torch.no_grad()
def test_fuse_q_v_only_touches_only_their_rows(toy_base, adapters, tmp_path):
    model = make_vllm_dit(toy_base.state_dict(), process=False)
    before = model.blocks[0].attn.to_qkv.weight.detach().clone()
    path = _export(
        adapters["qv"][1], str(tmp_path / "qv.safetensors"), prefix="", metadata={"r": 4, "lora_alpha": 8}
    )
    fuse_lora_into_model(model, path)
    after = model.blocks[0].attn.to_qkv.weight
    assert torch.equal(after[32:48], before[32:48])  # k rows untouched
    assert not torch.equal(after[:32], before[:32]) and not torch.equal(after[48:], before[48:])
    merged = _merged(adapters["qv"][1], 1.0)
    assert _fused_weight_error(model, merged) <= 1e-6


def test_fuse_refuses_processed_weights_and_changes_nothing(toy_base, adapters, tmp_path):
    path = _export(
        adapters["a"][1], str(tmp_path / "a.safetensors"), prefix="", metadata={"r": 4, "lora_alpha": 8}
    )
    model = make_vllm_dit(toy_base.state_dict(), process=False)
    process_weights(model.blocks[1])  # only the second block is repacked
    snapshot = {k: v.detach().clone() for k, v in model.blocks[0].state_dict().items()}
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        fuse_lora_into_model(model, path)
    assert all(torch.equal(v, model.blocks[0].state_dict()[k]) for k, v in snapshot.items())


def test_fuse_rejects_unmatched_and_non_finite(toy_base, adapters, tmp_path):
    model = make_vllm_dit(toy_base.state_dict(), process=False)
    path = _export(adapters["a"][1], str(tmp_path / "a.safetensors"), prefix="unet.mid.", metadata=None)
    with pytest.raises(LoRAFormatError, match="unmatched"):
        fuse_lora_into_model(model, path)
    with pytest.raises(ValueError, match="finite"):
        fuse_lora_into_model(model, path, scale=float("nan"))


@torch.no_grad()
def test_fuse_files_into_two_denoisers(tmp_path):
    """Wan2.2-style: the i-th file goes to the i-th denoiser (plain nn.Linear layers here)."""
    high, low = make_torch_dit(seed=1), make_torch_dit(seed=2)
    pipe = types.SimpleNamespace(transformer=copy.deepcopy(high), transformer_2=copy.deepcopy(low))
    peft_high = save_peft_adapter(high, str(tmp_path / "h"), seed=3)
    peft_low = save_peft_adapter(low, str(tmp_path / "l"), seed=4)
    meta = {"r": 4, "lora_alpha": 8.0}
    files = [
        _export(peft_high, str(tmp_path / "h.safetensors"), prefix="transformer.", metadata=meta),
        _export(peft_low, str(tmp_path / "l.safetensors"), prefix="", metadata=meta),
    ]
    done = fuse_lora_files_into_pipeline(pipe, files, [1.0, 0.5])
    assert set(done) == {"transformer", "transformer_2"} and len(done["transformer_2"]) == 16
    x, c = inputs(batch=1)
    assert (pipe.transformer(x, c) - _merged(peft_high, 1.0)(x, c)).abs().max().item() <= 1e-5
    assert (pipe.transformer_2(x, c) - _merged(peft_low, 0.5)(x, c)).abs().max().item() <= 1e-5
