"""LoHa / LoKr adapters on the toy DiT: parity against peft's LoHa / LoKr models on the same weights
(fp32, atol 1e-4), LyCORIS single files, composition with LoRA, mixed batches, the distill fuse,
cache accounting, and refusals that leave the cache unchanged."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from lora_toy_models import PEFT_TARGETS, inputs, make_vllm_dit
from safetensors.torch import load_file, save_file

from tools.lora_layouts import write_lycoris
from vllm_omni.diffusion.lora import DiffusionLoRAManager, fuse_lora_into_model
from vllm_omni.errors import InvalidAdapterError, LoRAFormatError
from vllm_omni.lora.request import LoRARequest

TOL = 1e-4

#: name -> (peft config class, kwargs); lokr_full: r large enough that peft stores w2 whole
SPECS = {
    "loha": ("LoHaConfig", dict(r=4, alpha=6.0)),
    "lokr": ("LoKrConfig", dict(r=2, alpha=3.0)),
    "lokr_both": ("LoKrConfig", dict(r=2, alpha=4.0, decompose_both=True, decompose_factor=4)),
    "lokr_full": ("LoKrConfig", dict(r=8, alpha=4.0)),
}


def _save_lycoris(base, path: str, cls_name: str, seed: int, **kwargs):
    import peft

    config = getattr(peft, cls_name)(target_modules=PEFT_TARGETS, **kwargs)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "hada_" in name or "lokr_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lyco(toy_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lycoris")
    out = {}
    for i, (name, (cls_name, kwargs)) in enumerate(SPECS.items()):
        out[name] = _save_lycoris(toy_base, str(root / name), cls_name, 40 + i, **kwargs)
        out[name + "_file"] = write_lycoris(out[name], str(root / f"{name}.safetensors"))
    out["loha_noalpha_file"] = write_lycoris(
        out["loha"], str(root / "loha_noalpha.safetensors"), with_alpha=False
    )
    return out


def _merged(base, adapters: dict[str, float]):
    """Oracle: base weights plus each adapter's update as peft merges it (``merge_and_unload`` at scale)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lycoris_utils import LycorisLayer

    model = copy.deepcopy(base)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for path, scale in adapters.items():
        peft_model = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
        for module in peft_model.modules():
            if isinstance(module, (LoraLayer, LycorisLayer)):
                module.set_scale("default", scale)
        merged = peft_model.merge_and_unload().state_dict()
        for key, value in merged.items():
            state[key] += value - base.state_dict()[key]
    model.load_state_dict(state)
    return model.eval()


def _peft_unmerged(base, path: str, scale: float):
    """peft's own LoHa / LoKr model (unmerged forward) at ``scale``."""
    from peft import PeftModel
    from peft.tuners.lycoris_utils import LycorisLayer

    model = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    for module in model.modules():
        if isinstance(module, LycorisLayer):
            module.set_scale("default", scale)
    return model


def _err(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def vllm_model(toy_base):
    return make_vllm_dit(toy_base.state_dict())


@pytest.fixture(scope="module")
def manager(vllm_model):
    return DiffusionLoRAManager(vllm_model, max_loras=3, max_rank=8, max_cpu_loras=6)


@pytest.mark.parametrize("name", ["loha", "lokr", "lokr_both", "lokr_full"])
@pytest.mark.parametrize("form", ["peft", "file"])
@torch.no_grad()
def test_alone_matches_peft(toy_base, lyco, vllm_model, manager, name, form):
    x, c = inputs(batch=2)
    path = lyco[name] if form == "peft" else lyco[name + "_file"]
    manager.set_active_adapters([LoRARequest(name, 100, path)], [0.7])
    ours = vllm_model(x, c)
    manager.deactivate()
    manager.remove_lora(100)
    oracle = _merged(toy_base, {lyco[name]: 0.7})(x, c)
    err = _err(ours, oracle)
    print(f"{name} ({form}): max abs err {err:.3g}")
    assert err <= TOL
    assert _err(ours, _peft_unmerged(toy_base, lyco[name], 0.7)(x, c)) <= TOL
    assert _err(ours, toy_base(x, c)) > 1e-2


@torch.no_grad()
def test_alpha_less_file_folds_scaling(toy_base, lyco, vllm_model, manager):
    x, c = inputs(batch=1)
    manager.set_active_adapters([LoRARequest("n", 101, lyco["loha_noalpha_file"])], [1.0])
    ours = vllm_model(x, c)
    manager.deactivate()
    manager.remove_lora(101)
    assert _err(ours, _merged(toy_base, {lyco["loha"]: 1.0})(x, c)) <= TOL


@torch.no_grad()
def test_composed_with_lora_and_mixed_batch(toy_base, adapters, lyco, vllm_model, manager):
    loha, lokr, lora = (
        LoRARequest("loha", 1, lyco["loha"]),
        LoRARequest("lokr", 2, lyco["lokr_file"]),
        LoRARequest("a", 3, adapters["a"][0]),
    )
    x, c = inputs(batch=3)
    manager.set_active_adapters([loha, lokr, lora], [0.8, -0.5, 0.6])  # one request, three formats
    composed = vllm_model(x, c)
    oracle = _merged(toy_base, {lyco["loha"]: 0.8, lyco["lokr"]: -0.5, adapters["a"][0]: 0.6})
    err = _err(composed, oracle(x, c))
    print(f"LoHa + LoKr + LoRA composed: max abs err {err:.3g}")
    assert err <= TOL
    samples = [[loha, lora], [lokr], []]
    scales = [[1.0, 0.5], [1.5], []]
    manager.set_active_adapters(samples, scales)
    mixed = vllm_model(x, c)
    manager.deactivate()
    refs = [
        _merged(toy_base, {lyco["loha"]: 1.0, adapters["a"][0]: 0.5}),
        _merged(toy_base, {lyco["lokr"]: 1.5}),
        toy_base,
    ]
    errs = [_err(mixed[n : n + 1], ref(x[n : n + 1], c[n : n + 1])) for n, ref in enumerate(refs)]
    print(f"mixed batch: max abs errs {errs}")
    assert max(errs) <= TOL
    assert torch.equal(mixed[2], vllm_model(x, c)[2])  # the adapter-free sample is the base, bit for bit


def test_cache_counts_real_bytes_and_ranks_skip_max_rank(lyco, manager):
    manager.add_lora(LoRARequest("full", 7, lyco["lokr_full"]))
    held = manager.cache_entry(7).payload
    total = sum(t.numel() * t.element_size() for w in held.values() for t in w.tensors())
    assert manager.cached_nbytes(7) == total > 0
    assert manager.cache_entry(7).meta["kinds"] == ["lokr"]
    # equivalent ranks above max_rank=8 are served (max_rank bounds LoRA files only)
    assert max(max(w.ranks) for w in held.values()) > 8
    manager.remove_lora(7)
    with pytest.raises(KeyError):
        manager.cached_nbytes(7)


@pytest.mark.parametrize("name", ["loha", "lokr_full"])
@torch.no_grad()
def test_distill_fuse_matches_peft_merge(toy_base, lyco, name):
    x, c = inputs(batch=2)
    model = make_vllm_dit(toy_base.state_dict(), process=False)
    fused = fuse_lora_into_model(model, lyco[name + "_file"], scale=1.3)
    assert fused
    from lora_toy_models import process_weights

    process_weights(model)
    err = _err(model(x, c), _merged(toy_base, {lyco[name]: 1.3})(x, c))
    print(f"fuse {name}: max abs err {err:.3g}")
    assert err <= TOL


def _edit_file(src: str, dst: str, edit) -> str:
    tensors = load_file(src)
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst)
    return dst


def _first(tensors, suffix):
    return next(k for k in sorted(tensors) if k.endswith(suffix))


REFUSALS = {
    "tucker": (
        lambda t: t.__setitem__(_first(t, "hada_w1_a").replace("w1_a", "t1"), torch.ones(4, 4, 1, 1)),
        r"hada_t1.*Tucker",
    ),
    "dora": (
        lambda t: t.__setitem__(_first(t, "hada_w1_a").replace("hada_w1_a", "dora_scale"), torch.ones(32, 1)),
        "DoRA",
    ),
    "missing": (lambda t: t.pop(_first(t, "hada_w2_b")), "lacks"),
    "shape": (lambda t: t.__setitem__(_first(t, "hada_w2_b"), torch.ones(4, 7)), "mismatched shapes"),
    "scalar": (
        lambda t: t.__setitem__(_first(t, "hada_w1_a").replace("hada_w1_a", "scalar"), torch.ones(1, 1)),
        "scalar",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_the_key_and_change_nothing(lyco, manager, tmp_path, case):
    edit, match = REFUSALS[case]
    bad = _edit_file(lyco["loha_file"], str(tmp_path / f"{case}.safetensors"), edit)
    manager.add_lora(LoRARequest("keep", 9, lyco["lokr"]))
    before = (manager.list_loras(), manager.slot_assignment(), manager.cached_nbytes())
    with pytest.raises(LoRAFormatError, match=match) as info:
        manager.add_lora(LoRARequest("bad", 10, bad))
    assert isinstance(info.value, InvalidAdapterError)
    assert bad in str(info.value)
    assert (manager.list_loras(), manager.slot_assignment(), manager.cached_nbytes()) == before
    manager.remove_lora(9)


@pytest.mark.parametrize(
    ("update", "match"),
    [
        ({"use_effective_conv2d": True}, "use_effective_conv2d"),
        ({"alpha": None}, "no alpha"),
        ({"r": 3}, "declares r=3"),
    ],
)
def test_peft_config_refusals(lyco, manager, tmp_path, update, match):
    out = tmp_path / "bad"
    shutil.copytree(lyco["loha"], out)
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(update)
    (out / "adapter_config.json").write_text(json.dumps(config))
    before = manager.list_loras()
    with pytest.raises(LoRAFormatError, match=match):
        manager.add_lora(LoRARequest("bad", 11, str(out)))
    assert manager.list_loras() == before


def test_wrong_layer_shape_names_module(toy_base, lyco, tmp_path):
    bad = _edit_file(
        lyco["lokr_file"],
        str(tmp_path / "wide.safetensors"),
        lambda t: t.__setitem__(_first(t, "to_q.lokr_w1"), torch.ones(8, 4)),
    )
    model = make_vllm_dit(toy_base.state_dict(), process=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoRAFormatError, match=r"lokr module .*to_q.* update of shape"):
        fuse_lora_into_model(model, bad)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_factor_identities_and_dense_fallback():
    from vllm_omni.diffusion.lora.formats.lycoris import cheapest_form, loha_factors, lokr_factors

    g = torch.Generator().manual_seed(0)
    w1a, w1b, w2a, w2b = (
        torch.randn(s, generator=g, dtype=torch.float64) for s in ((6, 3), (3, 10), (6, 2), (2, 10))
    )
    a, b = loha_factors(w1a, w1b, w2a, w2b)
    assert a.shape == (6, 10) and torch.allclose(b @ a, (w1a @ w1b) * (w2a @ w2b))
    u1, v1, u2, v2 = (
        torch.randn(s, generator=g, dtype=torch.float64) for s in ((2, 1), (1, 3), (4, 2), (2, 5))
    )
    a, b = lokr_factors((u1, v1), (u2, v2))
    assert a.shape == (2, 15) and torch.allclose(b @ a, torch.kron(u1 @ v1, u2 @ v2))
    # rank 12 on a 8 x 10 layer: the dense update (with an 8 x 8 identity) holds fewer numbers
    a, b = torch.randn(12, 10, generator=g), torch.randn(8, 12, generator=g)
    da, db = cheapest_form(a, b)
    assert da.shape == (8, 10) and torch.equal(db, torch.eye(8)) and torch.allclose(db @ da, b @ a, atol=1e-5)
    small = torch.randn(2, 10, generator=g), torch.randn(8, 2, generator=g)
    assert cheapest_form(*small)[0] is small[0]


def test_pin_and_lru_eviction_like_lora(toy_base, adapters, lyco):
    model = make_vllm_dit(toy_base.state_dict())
    mgr = DiffusionLoRAManager(model, max_loras=1, max_rank=8, max_cpu_loras=2)
    loha, lokr, lora = (
        LoRARequest("loha", 1, lyco["loha"]),
        LoRARequest("lokr", 2, lyco["lokr_file"]),
        LoRARequest("a", 3, adapters["a"][0]),
    )
    mgr.add_lora(loha)
    mgr.pin_lora(1)
    mgr.add_lora(lokr)
    mgr.add_lora(lora)  # evicts the least recently used unpinned adapter: the LoKr one
    assert mgr.list_loras() == [1, 3]
    mgr.set_active_adapters([loha], [1.0])
    assert mgr.slot_assignment() == {1: 0}
    mgr.set_active_adapters([lokr], [1.0])  # reloaded; evicts the LoRA, never the pinned LoHa
    assert sorted(mgr.list_loras()) == [1, 2] and mgr.slot_assignment() == {2: 0}
    assert mgr.cached_nbytes() == mgr.cached_nbytes(1) + mgr.cached_nbytes(2)
    mgr.deactivate()


@torch.no_grad()
def test_mixed_file_of_loha_and_lora_modules(toy_base, adapters, lyco, vllm_model, manager, tmp_path):
    from tools.lora_layouts import write_kohya

    loha = {k: v for k, v in load_file(lyco["loha_file"]).items() if "to_q" not in k and "to_v" not in k}
    lora = load_file(write_kohya(adapters["qv"][0], str(tmp_path / "qv.safetensors")))
    save_file(loha, str(tmp_path / "loha_part.safetensors"))
    save_file({**loha, **lora}, str(tmp_path / "mixed.safetensors"))
    x, c = inputs(batch=2)
    manager.set_active_adapters([LoRARequest("mixed", 20, str(tmp_path / "mixed.safetensors"))], [0.9])
    mixed = vllm_model(x, c)
    parts = [
        LoRARequest("part", 21, str(tmp_path / "loha_part.safetensors")),
        LoRARequest("qv", 22, str(tmp_path / "qv.safetensors")),
    ]
    manager.set_active_adapters(parts, [0.9, 0.9])
    separate = vllm_model(x, c)
    manager.deactivate()
    assert sorted(manager.cache_entry(20).meta["kinds"]) == ["loha", "lora"]
    for lora_id in (20, 21, 22):
        manager.remove_lora(lora_id)
    assert _err(mixed, separate) <= 1e-5
