"""Fixed-shape LoRA banks under dynamo: no recompile across adapter changes, same numbers as the slots.

The toy DiT's blocks are compiled regionally (``RegionalCompiler``) with a backend that counts the
graphs dynamo hands it and runs them as traced (no inductor: cheap, and the graph count is dynamo's,
whatever the backend). Reference: an identical toy whose manager runs the eager slot path.
"""

from __future__ import annotations

import pytest
import torch
from lora_toy_models import inputs, make_vllm_dit, save_lycoris_adapter

from vllm_omni.diffusion.compile import RegionalCompiler
from vllm_omni.diffusion.forward_context import denoising_step, set_forward_context
from vllm_omni.diffusion.lora import DiffusionLoRAManager, LoRAScaleSchedule
from vllm_omni.errors import InvalidRequestError, LoRAFormatError
from vllm_omni.lora.request import LoRARequest

TOL = 1e-5
RANK = 16


class CountingBackend:
    """A dynamo backend that records every graph it is given and runs it unchanged."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.fixture(scope="module")
def toys(toy_base, adapters, tmp_path_factory):
    eager = make_vllm_dit(toy_base.state_dict())
    compiled = make_vllm_dit(toy_base.state_dict())
    ref = DiffusionLoRAManager(eager, max_loras=3, max_rank=RANK, max_cpu_loras=6)
    banked = DiffusionLoRAManager(
        compiled, max_loras=3, max_rank=RANK, max_cpu_loras=6, banks=True, bank_rows=8
    )
    backend = CountingBackend()
    compiler = RegionalCompiler(
        compiled,
        cache_dir=str(tmp_path_factory.mktemp("compile_cache")),
        backend=backend,
        before_call=banked.sync_step,
        check_rows=banked.banks.check_rows,
    )
    reqs = {
        name: LoRARequest(name, i + 1, adapters[name][0]) for i, name in enumerate(["a", "b", "qv", "rs"])
    }
    root = tmp_path_factory.mktemp("lycoris")
    loha = save_lycoris_adapter(toy_base, str(root / "loha"), "LoHaConfig", 31, r=2, alpha=3.0)
    lokr = save_lycoris_adapter(toy_base, str(root / "lokr"), "LoKrConfig", 32, r=2, alpha=3.0)
    reqs["loha"], reqs["lokr"] = LoRARequest("loha", 11, loha), LoRARequest("lokr", 12, lokr)
    return eager, compiled, ref, banked, backend, compiler, reqs


@torch.no_grad()
def _run(toys, sets, batch, seq=5, seed=3, step=None):
    """Both toys on one input with per-sample ``sets`` (``[(requests, scales)]``, ``None``: no adapters)."""
    eager, compiled, ref, banked, *_ = toys
    x, c = inputs(batch=batch, seq=seq, seed=seed)
    outs = []
    for model, manager in ((eager, ref), (compiled, banked)):
        if sets is None:
            manager.deactivate()
        else:
            manager.set_active_adapters([s[0] for s in sets], [s[1] for s in sets])
        with set_forward_context():
            if step is None:
                outs.append(model(x, c))
            else:
                with denoising_step(*step):
                    outs.append(model(x, c))
        manager.deactivate()
    return outs


def _warm(toys):
    r = toys[-1]
    for batch in (1, 2):  # a batch of one is its own graph (dynamo specialises size 1)
        _run(toys, None, batch)
        _run(toys, [([r["a"]], [1.0])] * batch, batch)


def test_no_recompile_across_switches_and_eager_parity(toys):
    r, backend = toys[-1], toys[4]
    _warm(toys)
    warm = backend.graphs
    assert 1 <= warm <= 4
    per_step = LoRAScaleSchedule([0.0, 1.5, -0.5])
    per_block = LoRAScaleSchedule(0.8, {"blocks.1": 0.25, "blocks.0.ff*": -1.0})
    cases = [
        ([([r["b"]], [0.3])] * 2, 2, None),  # another adapter
        ([([r["a"], r["b"]], [0.5, -1.2])] * 3, 3, None),  # composition, another batch size
        ([([r["qv"]], [2.0]), ([], []), ([r["a"], r["rs"]], [0.4, 0.9])], 3, None),  # mixed batch
        ([([r["a"]], [per_step])] * 2, 2, (1, 3)),  # per-step schedule, step 1
        ([([r["a"]], [per_step])] * 2, 2, (2, 3)),
        ([([r["b"]], [per_block]), ([r["a"]], [1.0])], 2, None),  # per-block schedule in a mixed batch
        ([([r["rs"], r["qv"], r["b"]], [1.0, -0.3, 0.6])] * 5, 5, None),  # three slots, five rows
        ([([r["loha"], r["a"]], [0.7, 0.5]), ([r["lokr"]], [-1.1])], 2, None),  # LoHa / LoKr factors
    ]
    worst = 0.0
    for sets, batch, step in cases:
        for seq in (5, 9):  # sequence length is dynamic too
            want, got = _run(toys, sets, batch, seq=seq, step=step)
            worst = max(worst, (want - got).abs().max().item())
    print(
        f"banked (traced) vs eager slots: max abs err {worst:.2e}; graphs {backend.graphs} (warm-up {warm})"
    )
    assert worst <= TOL
    assert backend.graphs == warm, "an adapter / scale / schedule / batch change recompiled"
    assert toys[5].stats.graphs == warm


def test_zero_scale_rows_equal_base_bit_for_bit(toys):
    r = toys[-1]
    _warm(toys)
    base = _run(toys, None, 3, seed=9)[1]
    mixed = _run(toys, [([r["a"]], [0.0]), ([r["b"]], [1.0]), ([], [])], 3, seed=9)[1]
    assert torch.equal(mixed[0], base[0]) and torch.equal(mixed[2], base[2])
    assert not torch.allclose(mixed[1], base[1], atol=1e-3)


def test_bank_refuses_too_many_rows_and_keeps_activation(toys):
    _, compiled, _, banked, *_, r = toys
    banked.set_active_adapters([[r["a"]]] * 2, [[1.0]] * 2)
    before = banked.banks.table.clone()
    with pytest.raises(InvalidRequestError, match="9 denoiser rows.*holds 8"):
        banked.set_active_adapters([[r["b"]]] * 9, [[1.0]] * 9)
    assert banked.active_lora_ids == (r["a"].lora_int_id,)
    assert torch.equal(banked.banks.table, before)
    x, c = inputs(batch=9, seed=2)
    banked.set_active_adapters([r["a"]], [1.0])  # one set for every row: checked when the rows arrive
    with pytest.raises(InvalidRequestError, match="9 denoiser rows"), torch.no_grad():
        compiled(x, c)
    banked.deactivate()


def test_bank_refuses_lycoris_rank_above_bank(toy_base, tmp_path):
    """A LoHa whose LoRA-equivalent rank (r * r) exceeds max_rank: fine eagerly, refused by a bank."""
    path = save_lycoris_adapter(toy_base, str(tmp_path / "loha"), "LoHaConfig", 5, r=4, alpha=4.0)
    eager = DiffusionLoRAManager(make_vllm_dit(toy_base.state_dict()), max_loras=1, max_rank=8)
    assert eager.add_lora(LoRARequest("loha", 1, path))
    banked = DiffusionLoRAManager(make_vllm_dit(toy_base.state_dict()), max_loras=1, max_rank=8, banks=True)
    with pytest.raises(
        LoRAFormatError, match=r"loha.*layer 'blocks\.\d.*rank 16 exceeds the compiled bank's max rank 8"
    ):
        banked.add_lora(LoRARequest("loha", 1, path))
    assert banked.list_loras() == []


def test_bank_memory_is_slots_at_max_rank(toys):
    _, compiled, _, banked, *_ = toys
    want = 0
    for wrapper in banked.wrappers.values():
        g = wrapper.geometry
        want += 3 * RANK * (len(g.slices) * g.in_local + g.out_local) * 4
    assert banked.banks.nbytes() == want + banked.banks.table.numel() * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bank_expand_adds_every_slice_in_place(dtype):
    """The compiled expand op: each output slice gets its own column block of ``h`` times its ``B^T``,
    written into ``y`` itself (the GEMM accumulates, one rounding in bfloat16), other columns untouched."""
    from vllm_omni.diffusion.lora.ops import bank_expand_

    gen = torch.Generator().manual_seed(0)
    sizes, width, rows = (6, 4, 6), 3, 5
    y = torch.randn(rows, sum(sizes), generator=gen).to(dtype)
    h = torch.randn(rows, len(sizes) * width, generator=gen).to(dtype)
    bts = [torch.randn(width, n, generator=gen).to(dtype) for n in sizes]
    want = y.clone()
    offset = 0
    for i, (n, bt) in enumerate(zip(sizes, bts, strict=True)):
        ref = y[:, offset : offset + n].float() + h[:, i * width : (i + 1) * width].float() @ bt.float()
        want[:, offset : offset + n] = ref.to(dtype)  # exact sum, rounded once
        offset += n
    ptr = y.data_ptr()
    torch.ops.vllm_omni.lora_bank_expand_.default(y, h, bts)
    assert y.data_ptr() == ptr
    tol = 1e-5 if dtype == torch.float32 else 0.0
    # bfloat16: equal to the once-rounded exact result up to one unit in the last place
    ulp = (want.float().abs() * 2**-7).clamp_min(1e-30)
    err = (y.float() - want.float()).abs()
    assert (err <= tol + (ulp if dtype == torch.bfloat16 else 0)).all(), err.max()
    # and with a single slice spanning y, via the Python entry point
    y1, h1, bt1 = y[:, :6].contiguous(), h[:, :width].contiguous(), bts[0]
    before = y1.clone()
    bank_expand_(y1, h1, [bt1])
    torch.testing.assert_close(y1.float(), (before.float() + h1.float() @ bt1.float()), atol=0.05, rtol=0.02)


def test_a_slot_at_scale_zero_adds_nothing_even_when_its_shrink_is_not_finite(toys):
    """Each slot's shrink is selected per row, not only multiplied by its scale: a slot whose ``x A^T``
    is inf or NaN (here forced into its bank rows; at load, adapters that could do this for unit
    inputs are refused) changes neither the rows that list it at scale 0 nor the rows without it."""
    r, banked = toys[-1], toys[3]
    _warm(toys)
    sets = [([r["a"], r["b"]], [1.0, 0.0]), ([r["a"]], [0.7]), ([], [])]
    want, clean = _run(toys, sets, 3, seed=5)  # also makes a and b resident
    slot = banked.slot_assignment()[r["b"].lora_int_id]
    saved = {name: bank.a.clone() for name, bank in banked.banks.banks.items()}
    try:
        for bank in banked.banks.banks.values():
            width = bank.max_loras * bank.max_rank
            for i in range(bank.n_slices):
                start = i * width + slot * bank.max_rank
                bank.a[start : start + bank.max_rank] = float("inf")
        got = _run(toys, sets, 3, seed=5)[1]
    finally:
        for name, bank in banked.banks.banks.items():
            bank.a.copy_(saved[name])
    assert torch.isfinite(got).all()
    assert torch.equal(got, clean)
    assert (want - got).abs().max().item() <= TOL
