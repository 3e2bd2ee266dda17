"""Diffusion stages through Omni with PEFT adapters, against diffusers + peft on the same tiny Z-Image.

Every parity check runs the whole pipeline (text encoder, denoiser with CFG, scheduler) and compares
final latents with diffusers' ``ZImagePipeline`` whose transformer carries the same adapters
(``load_lora_adapter`` + ``set_adapters``), fp32, max abs error <= 1e-4.
"""

from __future__ import annotations

import math
import sys
import threading
import time

import pytest
import torch
from lora_oracle import reference_latents, reference_pipeline

from vllm_omni.entrypoints.request_adapters import request_adapters
from vllm_omni.errors import InvalidAdapterError, LoRAFormatError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest, RequestAdapters

TOL = 1e-4
KW = dict(seed=5, steps=2, guidance=3.0, height=32, width=32)
PROMPT = "a red cat on a mat"


def params(**overrides) -> OmniDiffusionSamplingParams:
    base = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.0, seed=5, output_type="latent")
    base.update(overrides)
    return OmniDiffusionSamplingParams(**base)


@pytest.fixture(scope="module")
def reqs(tiny_z_image_loras):
    return {
        name: LoRARequest(name, i + 1, str(tiny_z_image_loras[name]))
        for i, name in enumerate(("attn", "qv", "ff", "embed"))
    }


@pytest.fixture(scope="module")
def omni(tiny_z_image_dir):
    from vllm_omni import Omni

    engine = Omni(
        model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False, max_loras=3, max_cpu_loras=4
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def oracle(tiny_z_image_dir):
    cache: dict = {}

    def run(adapters=(), prompt=PROMPT, seed=KW["seed"]):
        key = (tuple((str(p), s) for p, s in adapters), prompt, seed)
        if key not in cache:
            pipe = reference_pipeline(tiny_z_image_dir, list(adapters))
            cache[key] = reference_latents(pipe, prompt, **{**KW, "seed": seed})
        return cache[key]

    return run


def _err(a, b) -> float:
    return (a - b).abs().max().item()


def _latents(omni, prompt=PROMPT, sp=None, **kw):
    return omni.generate(prompt=prompt, sampling_params=sp or params(), **kw)[0].latents


@pytest.mark.parametrize(
    ("names", "scales"),
    [
        (["attn"], [0.5]),
        (["attn"], [1.0]),
        (["attn"], [2.0]),
        (["qv"], [1.0]),
        (["ff"], [1.0]),
        (["embed"], [1.0]),
        (["attn", "qv"], [0.8, 0.6]),
        (["attn", "ff"], [0.8, -0.6]),
    ],
    ids=["attn0.5", "attn1", "attn2", "qv-packed", "ff-w13", "embedders", "attn+qv", "attn+ff-neg"],
)
def test_in_tree_pipeline_matches_diffusers_peft(omni, reqs, oracle, names, scales):
    got = _latents(omni, lora_requests=[reqs[n] for n in names], lora_scales=scales)
    expected = oracle([(reqs[n].lora_path, s) for n, s in zip(names, scales)])
    err, effect = _err(got, expected), _err(expected, oracle())
    print(f"in-tree {names} {scales}: max abs err {err:.2e} (adapter effect {effect:.3f})", file=sys.stderr)
    assert err <= TOL and effect > 50 * TOL


def test_conveniences_and_params_are_the_same_request(omni, reqs, oracle):
    a = reqs["attn"]
    via_params = _latents(omni, sp=params(lora_requests=[a], lora_scales=[2.0]))
    via_single = _latents(omni, lora_request=a, lora_scale=2.0)
    assert torch.equal(via_params, via_single)
    assert _err(via_single, oracle([(a.lora_path, 2.0)])) <= TOL
    # scales default to 1.0 each
    assert torch.equal(_latents(omni, lora_requests=[a]), _latents(omni, lora_request=a, lora_scale=1.0))


def test_scale_rules_and_base_after_lora(omni, reqs):
    a, q = reqs["attn"], reqs["qv"]
    base = _latents(omni)
    _latents(omni, lora_requests=[a, q], lora_scales=[1.0, 0.5])
    # a request without LoRA after LoRA requests is bit-identical to the base run
    assert torch.equal(_latents(omni), base)
    # scale 0 contributes exactly nothing, and the adapter stays cached
    assert torch.equal(_latents(omni, lora_request=a, lora_scale=0.0), base)
    assert a.lora_int_id in omni.list_loras()
    # scale 0 next to an active adapter == that adapter alone
    assert torch.equal(
        _latents(omni, lora_requests=[a, q], lora_scales=[0.0, 1.0]), _latents(omni, lora_request=q)
    )
    # changing the scale between requests takes effect
    assert (
        _err(_latents(omni, lora_request=a, lora_scale=1.0), _latents(omni, lora_request=a, lora_scale=0.5))
        > 1e-3
    )


def test_four_prompts_four_adapter_sets_in_one_batch_equal_solo_runs(omni, reqs, oracle):
    # `embed` targets the patch / caption embedders, which see the samples' tokens concatenated
    e, q, f = reqs["embed"], reqs["qv"], reqs["ff"]
    prompts = ["a red cat on a mat", "a blue house", "two birds", "a red cat on a mat"]
    sets = [[e], [], [q, f], [e, q]]
    scales = [[1.0], [], [0.7, -1.0], [0.5, 2.0]]
    stage = omni._orchestrator.runtimes[0]
    before = len(stage.batch_sizes)
    outs = omni.generate(prompts, params(), lora_requests=sets, lora_scales=scales)
    assert stage.batch_sizes[before:] == [4], "the four requests must share one denoiser batch"
    for prompt, s, sc, out in zip(prompts, sets, scales, outs):
        solo = _latents(omni, prompt, lora_requests=s, lora_scales=sc) if s else _latents(omni, prompt)
        assert _err(out.latents, solo) <= 1e-5, (prompt, [r.lora_name for r in s])
        ref = oracle([(r.lora_path, v) for r, v in zip(s, sc)], prompt=prompt)
        assert _err(out.latents, ref) <= TOL
    # the adapter-free request did not pick up anyone's adapter
    assert _err(outs[1].latents, oracle(prompt="a blue house")) <= TOL


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lora_requests=["attn", "qv"], lora_scales=[1.0]), "one entry per lora_requests"),
        (dict(lora_requests=["attn", "qv", "ff", "attn_again"]), "exceed max_loras=3"),
        (dict(lora_requests=["attn", "attn"]), "appears twice"),
        (dict(lora_requests=["attn"], lora_scales=[math.nan]), "finite"),
        (dict(lora_requests=["attn"], lora_scales=[math.inf]), "finite"),
        (dict(lora_scale=0.5), "lora_scale needs lora_request"),
        (dict(sp=params(height=40)), "height must be a multiple of 16"),
    ],
    ids=["unequal", "too-many", "twice", "nan", "inf", "scale-alone", "size"],
)
def test_bad_requests_fail_before_any_work(omni, reqs, kwargs, match):
    kwargs = dict(kwargs)
    if "lora_requests" in kwargs:
        named = {**reqs, "attn_again": LoRARequest("attn_again", 9, reqs["attn"].lora_path)}
        kwargs["lora_requests"] = [named[n] for n in kwargs["lora_requests"]]
    sp = kwargs.pop("sp", None)
    stage = omni._orchestrator.runtimes[0]
    cached, batches = omni.list_loras(), list(stage.batch_sizes)
    with pytest.raises(ValueError, match=match):
        omni.generate([PROMPT, PROMPT], sp or params(), **kwargs)
    assert omni.list_loras() == cached and stage.batch_sizes == batches


def test_sampling_params_reject_bad_lora_lists(reqs):
    a, q = reqs["attn"], reqs["qv"]
    for kwargs, match in [
        (dict(lora_requests=[a], lora_scales=[1.0, 2.0]), "one entry per lora_requests"),
        (dict(lora_requests=[a, a]), "appears twice"),
        (dict(lora_requests=[a, q], lora_scales=[1.0, float("nan")]), "finite"),
    ]:
        with pytest.raises(ValueError, match=match):
            params(**kwargs)


def test_missing_adapter_path_fails_before_work(omni, tmp_path):
    with pytest.raises(ValueError, match="no such path"):
        omni.generate(PROMPT, params(), lora_request=LoRARequest("x", 99, str(tmp_path / "missing")))


def test_failed_load_changes_nothing_and_fails_only_its_request(omni, reqs, tiny_z_image_loras, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_z_image_loras["qv"], bad)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if "layers.1.attention.to_v.lora_A" in k)[0]
    tensors[key] = torch.zeros(2, 63)  # the base layer takes 64 inputs
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    broken = LoRARequest("broken", 77, str(bad))
    omni.add_lora(reqs["attn"])
    cached = omni.list_loras()
    with pytest.raises(LoRAFormatError, match="to_v") as info:
        omni.add_lora(broken)
    print(f"failed load: {info.value}", file=sys.stderr)
    assert omni.list_loras() == cached
    # in a batch, the broken request fails alone; its neighbour is served
    stage = omni._orchestrator.runtimes[0]
    with stage.hold():
        ok = stage.submit(StageRequest(PROMPT, params(), RequestAdapters.of(reqs["attn"])))
        ko = stage.submit(StageRequest(PROMPT, params(), RequestAdapters.of(broken)))
    assert _err(ok.result().latents, _latents(omni, lora_request=reqs["attn"])) <= 1e-5
    with pytest.raises(LoRAFormatError):
        ko.result()
    assert omni.list_loras() == cached


def test_runtime_management_pin_and_lru(tiny_z_image_dir, reqs, oracle, tiny_z_image_loras, tmp_path):
    from vllm_omni import Omni

    a, q, f = reqs["attn"], reqs["qv"], reqs["ff"]
    with Omni(
        model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False, max_loras=1, max_cpu_loras=2
    ) as omni:
        assert omni.add_lora(a) and omni.pin_lora(a.lora_int_id)
        assert omni.add_lora(q) and omni.list_loras() == {1, 2}
        assert omni.add_lora(f)  # evicts the LRU unpinned adapter (qv), never the pinned one
        assert omni.list_loras() == {1, 3}
        assert omni.pin_lora(f.lora_int_id)
        with pytest.raises(Exception, match="cache is full"):
            omni.add_lora(q)  # every cached adapter is pinned
        assert omni.list_loras() == {1, 3}
        # a request still runs with an adapter it names (cache rules apply to loading, not to requests
        # whose adapter is cached)
        assert _err(_latents(omni, lora_request=a), oracle([(a.lora_path, 1.0)])) <= TOL
        assert omni.remove_lora(f.lora_int_id) and not omni.remove_lora(f.lora_int_id)
        assert omni.list_loras() == {1}
        _a_pinned_update_with_every_slot_pinned_swaps_in(omni, a, oracle, tiny_z_image_loras, tmp_path)


def _a_pinned_update_with_every_slot_pinned_swaps_in(omni, pinned, oracle, loras, tmp_path):
    """Issues 35 / 46: with every host-cache entry pinned, a new version of a pinned adapter (files
    rewritten in place, ``add_lora(reload=True)``) is read and checked off-slot, then takes the old
    version's pinned place (it was refused before): requests before the update get the loaded version,
    after it the new one (diffusers+peft on each); a version the stage refuses leaves the loaded one
    serving, pinned."""
    import shutil

    path = tmp_path / "v"
    shutil.copytree(loras["qv"], path)
    v = LoRARequest("v", 9, str(path))
    assert omni.add_lora(v) and omni.pin_lora(9) and omni.list_loras() == {1, 9}
    old, new = oracle([(loras["qv"], 1.0)]), oracle([(loras["ff"], 1.0)])
    assert _err(old, new) > 5e-3
    assert _err(_latents(omni, lora_request=v), old) <= TOL
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(loras["ff"] / name, path / name)
    assert omni.add_lora(v, reload=True)  # no room: swapped into the old version's pinned place
    assert _err(_latents(omni, lora_request=v), new) <= TOL
    record = omni.adapter_registry.get("v")
    assert omni.list_loras() == {1, 9} and record.version == 2 and record.stages[0].state == "pinned"
    (path / "adapter_model.safetensors").write_bytes(b"truncated")  # refused: version 2 keeps serving
    with pytest.raises(InvalidAdapterError, match="adapter_model.safetensors"):
        omni.add_lora(v, reload=True)
    assert omni.adapter_registry.get("v").version == 2 and omni.list_loras() == {1, 9}
    assert omni.remove_lora(9)


def test_remove_during_request_waits_for_it(tiny_z_image_dir, reqs, tiny_z_image_loras):
    from vllm_omni import Omni

    a = reqs["attn"]
    with Omni(model=str(tiny_z_image_dir), dtype="float32", enable_progress_bar=False) as omni:
        stage = omni._orchestrator.runtimes[0]
        sp = params(num_inference_steps=6)
        full = _latents(omni, sp=sp, lora_request=a)
        fut = stage.submit(StageRequest(PROMPT, sp, RequestAdapters.of(a)))
        while not stage.batch_sizes[1:]:
            time.sleep(0.002)
        removed: list = []
        t = threading.Thread(target=lambda: removed.append(omni.remove_lora(a.lora_int_id)))
        t.start()
        out = fut.result()
        t.join(timeout=600)
        # every step of the request ran with the adapter, then it was removed
        assert torch.equal(out.latents, full)
        assert removed == [True] and omni.list_loras() == set()


def test_startup_lora_path_preloads_pins_and_applies_its_scale(tiny_z_image_dir, tiny_z_image_loras, oracle):
    from vllm_omni import Omni
    from vllm_omni.lora.request import stable_lora_int_id

    path = str(tiny_z_image_loras["attn"])
    with Omni(
        model=str(tiny_z_image_dir),
        dtype="float32",
        enable_progress_bar=False,
        lora_path=path,
        lora_scale=0.5,
    ) as omni:
        lora_id = stable_lora_int_id(path)
        assert omni.list_loras() == {lora_id}
        # not applied unless requested
        assert _err(_latents(omni), oracle()) <= TOL
        got = _latents(omni, lora_request=LoRARequest("startup", lora_id, path))
        assert _err(got, oracle([(path, 0.5)])) <= TOL
        stage = omni._orchestrator.runtimes[0]
        assert stage.collective_rpc("list_loras") == [[lora_id]]


def test_bad_stage_inputs_name_the_field(tiny_z_image_dir, tmp_path, omni):
    import json

    from vllm_omni import Omni
    from vllm_omni.errors import StageEngineError

    model = tmp_path / "model"
    model.mkdir()
    index = json.loads((tiny_z_image_dir / "model_index.json").read_text())
    index["_class_name"] = "NoSuchPipeline"
    (model / "model_index.json").write_text(json.dumps(index))
    for name in ("scheduler", "text_encoder", "tokenizer", "transformer", "vae"):
        (model / name).symlink_to(tiny_z_image_dir / name)
    with pytest.raises(
        StageEngineError, match=r"Stage 0 \(diffusion\).*unknown pipeline class 'NoSuchPipeline'"
    ):
        Omni(model=str(model))
    # checked when the config resolves (before any engine starts), naming the stage
    with pytest.raises(ValueError, match=r"stage 0 \(diffusion\): max_lora_rank must be >= 1"):
        Omni(model=str(tiny_z_image_dir), max_lora_rank=0)
    with pytest.raises(ValueError, match="num_inference_steps must be an integer >= 1"):
        params(num_inference_steps=0)
    # the running stage is unaffected by all of this
    assert omni.generate(PROMPT, params(output_type="pil"))[0].images[0].size == (32, 32)


def test_request_adapters_built_at_the_entry_reach_the_worker_unchanged(omni, reqs):
    """The HTTP form (a tuple of RequestAdapter) runs exactly as the lora_requests / lora_scales form:
    one converter at the edge gives one typed value, which reaches the worker as it is."""
    from vllm_omni.errors import InvalidRequestError
    from vllm_omni.lora.request import RequestAdapter

    adapters = (RequestAdapter(reqs["attn"], 0.5), RequestAdapter(reqs["qv"]))
    descriptions = omni._orchestrator.descriptions
    [per_stage] = request_adapters(omni.config, descriptions, 1, [params()], adapters=adapters)
    assert per_stage == {0: RequestAdapters(adapters)}
    [from_lists] = request_adapters(
        omni.config,
        descriptions,
        1,
        [params()],
        lora_requests=[reqs["attn"], reqs["qv"]],
        lora_scales=[0.5, 1.0],
    )
    assert [(a.lora, a.scale) for a in from_lists[0]] == [(reqs["attn"], 0.5), (reqs["qv"], 1.0)]
    via_adapters = omni._orchestrator.submit(PROMPT, [params()], per_stage).result(timeout=300)[0].latents
    via_lists = omni.generate(
        PROMPT, params(), lora_requests=[reqs["attn"], reqs["qv"]], lora_scales=[0.5, 1.0]
    )[0].latents
    torch.testing.assert_close(via_adapters, via_lists, rtol=0, atol=0)
    with pytest.raises(InvalidRequestError, match="not both"):
        request_adapters(omni.config, descriptions, 1, [params()], lora_request=reqs["ff"], adapters=adapters)
    with pytest.raises(InvalidRequestError, match=r"adapters\[1\].*appears twice") as info:
        request_adapters(omni.config, descriptions, 1, [params()], adapters=adapters[:1] * 2)
    assert info.value.param == "adapters"  # the field at fault (the HTTP layer names it "lora")


def test_a_folder_holding_one_single_file_adapter_is_that_file_through_omni(
    omni, reqs, tiny_z_image_loras, tmp_path
):
    """Issue 35 rule 4 through ``Omni``: a folder with one single-file adapter and no
    ``adapter_config.json`` serves the latents of that file by its own path (and of the PEFT folder of
    the same weights); with a second file it is refused at ``add_lora`` and in a request, naming what a
    PEFT folder holds and the files to pass instead; nothing is registered or cached."""
    import shutil

    folder = tmp_path / "my_lora"
    folder.mkdir()
    single = folder / "attn_v2.safetensors"
    shutil.copy(tiny_z_image_loras["attn_file"], single)
    by_folder = _latents(omni, lora_request=LoRARequest("folder", 30, str(folder)))
    by_file = _latents(omni, lora_request=LoRARequest("file", 32, str(single)))
    torch.testing.assert_close(by_folder, by_file, rtol=0, atol=0)
    assert _err(by_file, _latents(omni, lora_request=reqs["attn"])) <= 1e-5
    shutil.copy(single, folder / "attn_v3.safetensors")
    before, registered = omni.list_loras(), omni.adapter_registry.records()
    lora = LoRARequest("two_files", 31, str(folder))
    for call in (lambda: omni.add_lora(lora), lambda: omni.generate(PROMPT, params(), lora_request=lora)):
        with pytest.raises(LoRAFormatError) as info:
            call()
        message = str(info.value)
        assert "missing adapter_config.json and adapter_model.safetensors" in message, message
        assert f"'{single}'" in message and "pass one by its own path instead" in message
    assert omni.list_loras() == before and omni.adapter_registry.records() == registered
