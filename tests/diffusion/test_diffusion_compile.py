"""Compiled diffusion stage (``enforce_eager=False``, inductor on CPU) on the tiny Z-Image.

One compiled engine and one eager engine are shared by the module (the compiled one builds a graph
per LoRA off / on and attention mask present / absent; every request uses CFG, so the batch always
has two rows or more). Compared: compiled vs eager latents (fp32, max abs error
<= 1e-4: different kernel fusion, same maths), compiled vs diffusers + peft on the same weights, and
the number of dynamo graphs, which must not grow after warm-up whatever adapters, scales,
schedules, batch composition, batch size (within the bucket of two rows and more) and image size.
"""

from __future__ import annotations

import sys

import pytest
import torch
from lora_oracle import merged_reference_pipeline, reference_latents

from tools.make_tiny_diffusion_lora import build_lycoris_adapter
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest, RequestAdapter
from vllm_omni.lora.schedule import LoRAScaleSchedule

pytestmark = pytest.mark.slow

TOL = 1e-4
PROMPTS = ["a green teapot", "a lighthouse on a cliff at night", "red"]
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]


def params(**overrides) -> OmniDiffusionSamplingParams:
    base = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.0, seed=3, output_type="latent")
    base.update(overrides)
    return OmniDiffusionSamplingParams(**base)


def _config(model, **kw) -> OmniDiffusionConfig:
    # graphs compile in the requests here (inductor: each costs up to a minute on this CPU); the default
    # start-up warm-up is test_compile_warmup.py's
    kw.setdefault("compile_warm_up", False)
    return OmniDiffusionConfig(
        model=str(model),
        dtype="float32",
        device="cpu",
        enable_progress_bar=False,
        max_loras=4,
        max_cpu_loras=8,
        **kw,
    )


@pytest.fixture(scope="module")
def engines(tiny_z_image_dir, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("compile_cache"))
    compiled = DiffusionEngine(_config(tiny_z_image_dir, enforce_eager=False, compile_cache_dir=cache))
    eager = DiffusionEngine(_config(tiny_z_image_dir, enforce_eager=True))
    yield compiled, eager
    compiled.shutdown()
    eager.shutdown()


@pytest.fixture(scope="module")
def reqs(tiny_z_image_dir, tiny_z_image_loras, tmp_path_factory):
    root = tmp_path_factory.mktemp("z_lycoris")
    folder = tiny_z_image_dir / "transformer"
    loha = build_lycoris_adapter(folder, root / "loha", "loha", 201, TARGETS, r=4, alpha=6.0)
    lokr = build_lycoris_adapter(
        folder, root / "lokr", "lokr", 202, TARGETS, r=2, alpha=3.0, decompose_both=True, decompose_factor=4
    )
    paths = {name: str(tiny_z_image_loras[name]) for name in ("attn", "qv", "ff", "embed")}
    paths.update(loha=str(loha), lokr=str(lokr))
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}


def _run(engine, sets, prompts=PROMPTS, **sp):
    """Latents of one batch whose i-th prompt uses ``sets[i]`` (``[(request, scale), ...]``)."""
    lora_sets = [tuple(RequestAdapter(r, s) for r, s in entries) for entries in sets]
    outs = engine.worker.generate_batch(list(prompts[: len(sets)]), params(**sp), lora_sets)
    return torch.cat([o.latents for o in outs])


def _err(a, b) -> float:
    return (a - b).abs().max().item()


def _graphs(engine) -> int:
    return sum(c.stats.graphs for c in engine.worker.compilers)


def test_compiled_equals_eager_mixed_composed_cfg(engines, reqs):
    compiled, eager = engines
    r = reqs
    sets = [[(r["attn"], 0.8), (r["ff"], -0.5)], [(r["qv"], 1.2), (r["embed"], 0.7)], []]
    got, want = _run(compiled, sets), _run(eager, sets)
    base = _run(compiled, [[], [], []])
    print(f"mixed batch compiled vs eager: {_err(got, want):.2e}", file=sys.stderr)
    assert _err(got, want) <= TOL
    assert _err(got[0], base[0]) > 50 * TOL
    # the adapter-free prompt equals the compiled base run of the same batch bit for bit
    assert torch.equal(got[2], base[2])
    assert compiled.worker.compilers and _graphs(compiled) >= 2


@pytest.mark.parametrize(
    "scale",
    [
        LoRAScaleSchedule([1.5, -0.4]),
        LoRAScaleSchedule(0.9, {"layers.1": 0.25, "layers.0.feed_forward*": -1.0}),
        LoRAScaleSchedule.parse(
            [{"start": 0.0, "end": 0.5, "scale": 0.0}, {"start": 0.5, "end": 1.0, "scale": 1.3}]
        ),
    ],
    ids=["per-step", "per-block", "ranges"],
)
def test_compiled_schedules_equal_eager(engines, reqs, scale):
    compiled, eager = engines
    sets = [[(reqs["attn"], scale), (reqs["ff"], 0.6)], [(reqs["attn"], 1.0)]]
    got, want = _run(compiled, sets), _run(eager, sets)
    assert _err(got, want) <= TOL


def test_compiled_loha_lokr_equal_eager_and_peft(engines, reqs, tiny_z_image_dir):
    compiled, eager = engines
    # two prompts of different caption lengths: the graph of the other tests (attention mask present)
    sets = [[(reqs["loha"], 0.8), (reqs["lokr"], -0.5), (reqs["attn"], 0.6)], []]
    got, want = _run(compiled, sets), _run(eager, sets)
    assert _err(got, want) <= TOL
    got = got[:1]
    pipe = merged_reference_pipeline(
        tiny_z_image_dir,
        [(reqs["loha"].lora_path, 0.8), (reqs["lokr"].lora_path, -0.5), (reqs["attn"].lora_path, 0.6)],
    )
    ref = reference_latents(pipe, PROMPTS[0], seed=3, steps=2, guidance=3.0, height=32, width=32)
    print(f"compiled vs diffusers+peft: {_err(got, ref):.2e}", file=sys.stderr)
    assert _err(got, ref) <= TOL


def test_no_recompile_after_warm_up(engines, reqs):
    compiled, _ = engines
    r = reqs
    # warm-up: the four variants of a batch of two rows and more (docs/user_guide/diffusion_compile.md;
    # compile_warm_up also compiles the one-row ones, test_compile_warmup.py), i.e.
    # LoRA off / on x attention mask present (captions of different lengths) / absent (one prompt);
    # then no size, adapter, scale, schedule or batch composition inside the bucket compiles again
    _run(compiled, [[], []])
    _run(compiled, [[(r["attn"], 1.0)], []])
    _run(compiled, [[]])
    _run(compiled, [[(r["attn"], 1.0)]])
    warm = _graphs(compiled)
    counters = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    requests = [
        ([[(r["ff"], 0.3)]], {}),
        ([[(r["qv"], -2.0), (r["attn"], 0.1)], [(r["ff"], 1.0)], [(r["embed"], 0.5)]], {}),
        ([[(r["loha"], 1.0)], [(r["lokr"], 0.4)]], {"height": 48, "width": 32}),
        ([[(r["attn"], LoRAScaleSchedule([0.0, 2.0]))]] * 3, {"height": 32, "width": 64}),
        ([[(r["attn"], LoRAScaleSchedule(1.0, {"layers.0": 0.5}))], []], {"num_inference_steps": 3}),
        ([[(r["attn"], 0.0)], [(r["ff"], 0.0)]], {}),  # all scales zero: the base graph
    ]
    for sets, sp in requests:
        _run(compiled, sets, **sp)
    assert _graphs(compiled) == warm, "a request within the bucket recompiled"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == counters


def test_tp2_compiled_equals_eager(tiny_z_image_dir, engines, reqs, tmp_path):
    """Two ranks trace their sharded blocks (collectives, LoRA banks) with ``compile_backend="aot_eager"``:
    dynamo and AOTAutograd as under inductor, without its code generation, which the single-rank tests
    above run (inductor on both ranks cost ~85 s of CPU for the same check of the traced graph)."""
    _, eager = engines
    tp2 = DiffusionEngine(
        _config(
            tiny_z_image_dir,
            enforce_eager=False,
            tensor_parallel_size=2,
            compile_cache_dir=str(tmp_path),
            compile_backend="aot_eager",
        )
    )
    try:
        sets = [[(reqs["attn"], 0.8), (reqs["ff"], -0.5)], []]
        lora_sets = [tuple(RequestAdapter(a, s) for a, s in entries) for entries in sets]
        outs = tp2.collective_rpc("generate_batch", PROMPTS[:2], params(), lora_sets)[0]
        got = torch.cat([o.latents for o in outs])
        want = _run(eager, sets)
        assert _err(got, want) <= TOL
        assert _err(want[0], _run(eager, [[], []])[0]) > 50 * TOL  # the adapter did change prompt 0
        assert all(n >= 1 for n in tp2.collective_rpc(_graphs_of_worker))
    finally:
        tp2.shutdown()


def _graphs_of_worker(worker) -> int:
    return sum(c.stats.graphs for c in worker.compilers)


def test_diffusers_fallback_compiled_with_lora_matches_peft(tiny_z_image_dir, reqs, tmp_path):
    """The diffusers fallback compiles its transformer's blocks too; LoRA (banks on nn.Linear) keeps
    parity with diffusers + peft."""
    engine = DiffusionEngine(
        _config(
            tiny_z_image_dir,
            enforce_eager=False,
            pipeline_backend="diffusers",
            compile_cache_dir=str(tmp_path),
        )
    )
    try:
        assert engine.worker.compilers, "the fallback transformer was not compiled"
        got = _run(engine, [[(reqs["attn"], 0.8)]])
        pipe = merged_reference_pipeline(tiny_z_image_dir, [(reqs["attn"].lora_path, 0.8)])
        ref = reference_latents(pipe, PROMPTS[0], seed=3, steps=2, guidance=3.0, height=32, width=32)
        print(f"fallback compiled vs diffusers+peft: {_err(got, ref):.2e}", file=sys.stderr)
        assert _err(got, ref) <= TOL
        assert _graphs(engine) >= 1
    finally:
        engine.shutdown()
