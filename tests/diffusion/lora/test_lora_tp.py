"""Tensor parallelism (2 gloo ranks on CPU): sharded LoRA buffers and fused weights match the TP=1 oracle."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
import torch.multiprocessing as mp
from lora_toy_models import inputs, make_torch_dit, save_peft_adapter, tp_worker
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file


def _oracle(base, dirs_scales: list[tuple[str, float]]):
    names = [f"n{i}" for i in range(len(dirs_scales))]
    model = PeftModel.from_pretrained(copy.deepcopy(base), dirs_scales[0][0], adapter_name=names[0])
    for name, (path, _) in zip(names[1:], dirs_scales[1:], strict=True):
        model.load_adapter(path, adapter_name=name)
    model.base_model.set_adapter(names)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, (_, scale) in zip(names, dirs_scales, strict=True):
                module.set_scale(name, scale)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: K/V heads replicated across the two ranks
def test_tp2_matches_single_rank_peft(tmp_path, kv_heads):
    base = make_torch_dit(seed=0, kv_heads=kv_heads)
    a = save_peft_adapter(base, str(tmp_path / "a"), seed=30)
    save_peft_adapter(
        base, str(tmp_path / "b"), seed=31, r=8, lora_alpha=4.0, targets=["to_q", "to_v", "w2", "w3"]
    )
    torch.save(base.state_dict(), tmp_path / "base.pt")
    tensors = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(a).items()}
    save_file(
        tensors,
        str(tmp_path / "a.safetensors"),
        metadata={"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 8})},
    )
    pa, pb = str(tmp_path / "a"), str(tmp_path / "b")
    sets = [([(1, pa)], [1.0]), ([(1, pa), (2, pb)], [0.5, -1.0]), ([], [])]
    job = {
        "state_dict": str(tmp_path / "base.pt"),
        "kv_heads": kv_heads,
        "sets": sets,
        "fuse_file": str(tmp_path / "a.safetensors"),
        "fuse_scale": 0.7,
        "out": str(tmp_path / "out.pt"),
    }
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=tp_worker, args=(r, 2, str(tmp_path / "pg"), job)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=1800)  # a cap on a hang, not a speed bound
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    out = torch.load(tmp_path / "out.pt")
    x, c = inputs(batch=3, seed=21)
    with torch.no_grad():
        expected = [
            _oracle(base, [(pa, 1.0)])(x[0:1], c[0:1])[0],
            _oracle(base, [(pa, 0.5), (pb, -1.0)])(x[1:2], c[1:2])[0],
            base(x[2:3], c[2:3])[0],
        ]
        fused_ref = _oracle(base, [(pa, 0.7)])(x, c)
    errs = [(out["batched"][i] - e).abs().max().item() for i, e in enumerate(expected)]
    ferr = (out["fused"] - fused_ref).abs().max().item()
    print(f"TP=2 kv_heads={kv_heads}: batched errs {errs}, fused err {ferr:.3g}", file=sys.stderr)
    assert max(errs) <= 1e-5 and ferr <= 1e-5
