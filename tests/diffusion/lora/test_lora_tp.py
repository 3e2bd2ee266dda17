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


KV_HEADS = (2, 1)  # 1: K/V heads replicated across the two ranks


def _job(root, kv_heads: int) -> tuple[dict, object, str, str]:
    """A TP job for one toy (``kv_heads``): its files under ``root``, the base model and the adapter dirs."""
    root.mkdir()
    base = make_torch_dit(seed=0, kv_heads=kv_heads)
    a = save_peft_adapter(base, str(root / "a"), seed=30)
    save_peft_adapter(
        base, str(root / "b"), seed=31, r=8, lora_alpha=4.0, targets=["to_q", "to_v", "w2", "w3"]
    )
    torch.save(base.state_dict(), root / "base.pt")
    tensors = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(a).items()}
    save_file(
        tensors,
        str(root / "a.safetensors"),
        metadata={"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 8})},
    )
    pa, pb = str(root / "a"), str(root / "b")
    job = {
        "state_dict": str(root / "base.pt"),
        "kv_heads": kv_heads,
        "sets": [([(1, pa)], [1.0]), ([(1, pa), (2, pb)], [0.5, -1.0]), ([], [])],
        "fuse_file": str(root / "a.safetensors"),
        "fuse_scale": 0.7,
        "out": str(root / "out.pt"),
    }
    return job, base, pa, pb


@pytest.mark.slow
def test_tp2_matches_single_rank_peft(tmp_path):
    """Both toys (K/V heads sharded, and replicated) in one pair of rank processes."""
    cases = [_job(tmp_path / f"kv{kv}", kv) for kv in KV_HEADS]
    ctx = mp.get_context("spawn")
    jobs = [job for job, *_ in cases]
    procs = [ctx.Process(target=tp_worker, args=(r, 2, str(tmp_path / "pg"), jobs)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=1800)  # a cap on a hang, not a speed bound
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    x, c = inputs(batch=3, seed=21)
    for job, base, pa, pb in cases:
        out = torch.load(job["out"])
        with torch.no_grad():
            expected = [
                _oracle(base, [(pa, 1.0)])(x[0:1], c[0:1])[0],
                _oracle(base, [(pa, 0.5), (pb, -1.0)])(x[1:2], c[1:2])[0],
                base(x[2:3], c[2:3])[0],
            ]
            fused_ref = _oracle(base, [(pa, 0.7)])(x, c)
        errs = [(out["batched"][i] - e).abs().max().item() for i, e in enumerate(expected)]
        ferr = (out["fused"] - fused_ref).abs().max().item()
        print(f"TP=2 kv_heads={job['kv_heads']}: batched errs {errs}, fused err {ferr:.3g}", file=sys.stderr)
        assert max(errs) <= 1e-5 and ferr <= 1e-5, job["kv_heads"]
        assert (expected[0] - base(x[0:1], c[0:1])[0]).abs().max().item() > 1e-3  # the adapter changes the output
