"""Two in-process replicas of a diffusion stage (tiny Z-Image, PEFT adapters) against one replica.

Same requests, same seeds: every output of the 2-replica stage equals the 1-replica stage's; the
requests are spread over both replicas; adapters added, pinned and removed reach both replicas, a
failure injected on one rolls the other back, and ``list_loras`` is the same on each.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_omni.engine.replicas import ReplicatedStageRuntime
from vllm_omni.errors import LoRACacheError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.request import LoRARequest

PROMPTS = ["a red cat on a mat", "a blue house", "two birds", "a green tree"]


def params(**kw) -> OmniDiffusionSamplingParams:
    base = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.0, seed=5, output_type="latent")
    return OmniDiffusionSamplingParams(**{**base, **kw})


def _omni(model, **kw):
    from vllm_omni import Omni

    return Omni(
        model=str(model), dtype="float32", enable_progress_bar=False, max_loras=2, max_cpu_loras=4, **kw
    )


@pytest.fixture(scope="module")
def reqs(tiny_z_image_loras):
    return {n: LoRARequest(n, i + 1, str(tiny_z_image_loras[n])) for i, n in enumerate(("attn", "qv", "ff"))}


@pytest.fixture(scope="module")
def engines(tiny_z_image_dir):
    one = _omni(tiny_z_image_dir)  # first: starting an engine at all sets vLLM's own variables
    env_before = dict(os.environ)
    two = _omni(tiny_z_image_dir, replicas=2, devices="cpu")
    env_after = dict(os.environ)
    yield one, two, (env_before, env_after)
    two.shutdown()
    one.shutdown()


def _replicas(two) -> ReplicatedStageRuntime:
    runtime = two._orchestrator.runtimes[0]
    assert isinstance(runtime, ReplicatedStageRuntime) and len(runtime.runtimes) == 2
    return runtime


def _run(omni, reqs, lora=True):
    sets = [[reqs["attn"]], [], [reqs["qv"], reqs["ff"]], [reqs["attn"]]] if lora else None
    scales = [[0.8], [], [0.7, -1.0], [1.5]] if lora else None
    outs = omni.generate(PROMPTS, params(), lora_requests=sets, lora_scales=scales)
    return [o.latents for o in outs]


def test_inline_replicas_leave_the_environment_alone(engines):
    _, _, (before, after) = engines
    assert before == after


def test_two_replicas_equal_one_and_share_the_work(engines, reqs):
    one, two, _ = engines
    rep = _replicas(two)
    done_before = [sum(r.batch_sizes) for r in rep.runtimes]
    got, expected = _run(two, reqs), _run(one, reqs)
    done = [sum(r.batch_sizes) - b for r, b in zip(rep.runtimes, done_before)]
    assert done == [2, 2], "least-loaded dispatch spreads a burst of 4 over both replicas"
    for g, e in zip(got, expected):
        assert (g - e).abs().max().item() <= 1e-5
    assert not torch.equal(got[0], got[1])  # the requests differ (adapters, prompts)
    assert rep.in_flight() == [0, 0]


def test_adapter_calls_reach_both_replicas(engines, reqs):
    one, two, _ = engines
    rep = _replicas(two)
    a = reqs["attn"]
    two.add_lora(a, stage_id=0)
    one.add_lora(a, stage_id=0)
    per_replica = [r.list_loras() for r in rep.runtimes]
    assert all(a.lora_int_id in ids for ids in per_replica)
    # adapters a request loaded on its own replica are not listed: the answer is the same on both
    assert two.list_loras() == per_replica[0] & per_replica[1]
    assert two.pin_lora(a.lora_int_id) is True
    out2 = two.generate(PROMPTS[:2], params(), lora_request=a)
    out1 = one.generate(PROMPTS[:2], params(), lora_request=a)
    assert all((x.latents - y.latents).abs().max().item() <= 1e-5 for x, y in zip(out2, out1))
    assert two.remove_lora(a.lora_int_id) is True
    assert all(a.lora_int_id not in r.list_loras() for r in rep.runtimes)


def test_failure_on_one_replica_rolls_back_the_other(engines, reqs, monkeypatch):
    _, two, _ = engines
    rep = _replicas(two)
    new = LoRARequest("ff_again", 42, reqs["ff"].lora_path)
    before = [r.list_loras() for r in rep.runtimes]
    assert new.lora_int_id not in before[0]

    def broken(lora_request):
        raise LoRACacheError("injected: host cache full")

    monkeypatch.setattr(rep.runtimes[1], "add_lora", broken)
    with pytest.raises(
        LoRACacheError, match=r"replica 1 of 2: add_lora failed \(rolled back on replica\(s\) \[0\]\)"
    ):
        two.add_lora(new, stage_id=0)
    assert [r.list_loras() for r in rep.runtimes] == before
    assert two.list_loras() == before[0] & before[1]


def test_a_rewritten_adapter_is_a_new_version_on_every_replica(engines, reqs, tmp_path):
    """Issue 21 rule 1 on replicas: files rewritten at a registered adapter's path are a new version
    on both replicas (``reload=True``, and with no call at all): every prompt of a burst spread
    over the two replicas equals the one-replica stage on the files on disk at that moment, never
    a replica's cached copy of the old weights."""
    import shutil

    one, two, _ = engines
    rep = _replicas(two)
    path = tmp_path / "v"
    shutil.copytree(reqs["attn"].lora_path, path)
    lora = LoRARequest("v", 77, str(path))

    def rewrite(src: str) -> None:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(os.path.join(src, name), path / name)

    def burst(omni, adapter):
        return [o.latents for o in omni.generate(PROMPTS, params(), lora_request=adapter)]

    def same(got, want) -> bool:
        return all((g - w).abs().max().item() <= 1e-5 for g, w in zip(got, want, strict=True))

    assert two.add_lora(lora)
    try:
        before = [sum(r.batch_sizes) for r in rep.runtimes]
        assert same(burst(two, lora), burst(one, reqs["attn"]))
        assert [sum(r.batch_sizes) - b for r, b in zip(rep.runtimes, before)] == [2, 2]
        rewrite(reqs["qv"].lora_path)
        assert two.add_lora(lora, reload=True) is True  # new content: a new version
        assert same(burst(two, lora), burst(one, reqs["qv"]))
        rewrite(reqs["attn"].lora_path)  # rewritten again, no call: requests get what is on disk
        assert same(burst(two, lora), burst(one, reqs["attn"]))
        assert two.adapter_registry.get("v").version == 3
    finally:
        two.remove_lora(lora.lora_int_id)
    assert all(lora.lora_int_id not in r.list_loras() for r in rep.runtimes)
