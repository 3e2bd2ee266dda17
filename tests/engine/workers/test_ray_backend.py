"""The Ray worker backend on a local two-node cluster (``ray.cluster_utils.Cluster``).

Stage 0 is pinned to node A and stage 1 to node B by custom resources (``ray_resources``);
outputs equal the inline backend's (the LLM stages against transformers+peft, as the inline
tests check them; the diffusion stage against an inline runtime of the same stage); a dead
actor fails its in-flight requests with ``StageDeadError`` and the stage comes back with the
adapters it had; nothing of a pipeline is left in the cluster after ``shutdown()``.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from tests.llm_reference import hf_greedy
from vllm_omni.errors import ConfigError, StageDeadError, StageEngineError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.engine, pytest.mark.slow]

N = 8
DIFF = dict(height=32, width=32, num_inference_steps=2, guidance_scale=2.0, seed=4)


@pytest.fixture(scope="module")
def cluster():
    """Node A (head, resource ``node_a``) and node B (``node_b``), one CPU each; this process connected."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    two = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}})
    two.add_node(num_cpus=1, resources={"node_b": 1})
    ray.init(address=two.address)
    yield two
    ray.shutdown()
    two.shutdown()


@pytest.fixture(scope="module")
def z_image_dir():
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return ensure_tiny_diffusion_assets(test_assets_root())["z_image"]


def _node_ids(cluster) -> tuple[str, str]:
    head, other = cluster.head_node, cluster.worker_nodes
    return head.node_id, next(iter(other)).node_id


def _assert_nothing_left() -> None:
    """No live actor and no placement group that is not removed, in the whole cluster."""
    alive = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
    assert alive == []
    groups = ray.util.placement_group_table().values()
    assert [g for g in groups if g["state"] != "REMOVED"] == []


def _wait_recovered(runtime, restarts: int, timeout: float = 900.0) -> None:
    start = time.monotonic()
    while runtime.restarts < restarts:
        assert time.monotonic() - start < timeout, f"{runtime.stage.label} did not come back"
        time.sleep(0.5)


def test_llm_chain_stages_on_two_nodes_match_inline(cluster, tiny_llm_assets, tmp_path):
    from vllm_omni import Omni

    model = str(tiny_llm_assets.model_dir)
    deploy = tmp_path / "chain.yaml"
    deploy.write_text(
        f"pipeline: llm_chain\n"
        f"worker_backend: ray\n"
        f"stages:\n"
        f"  - stage_id: 0\n    model: {model}\n    enable_lora: true\n    max_lora_rank: 16\n"
        f"    ray_resources: {{node_a: 1}}\n"
        f"    engine_extras: {{max_model_len: 256, dtype: float32}}\n"
        f"  - stage_id: 1\n    model: {model}\n    max_model_len: 256\n    dtype: float32\n"
        f"    ray_resources: {{node_b: 1}}\n"
    )
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    adapter = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    with Omni(deploy_config=str(deploy)) as omni:
        stage0, stage1 = omni._orchestrator.runtimes
        assert (stage0.info["node_id"], stage1.info["node_id"]) == _node_ids(cluster)
        # each actor's runtime describes itself; the proxy hands the description over unchanged
        d0, d1 = stage0.describe(), stage1.describe()
        assert (d0.output_kind, d0.max_model_len, d0.adapters.kind, d1.adapters) == ("text", 256, "llm", None)
        assert (d1.stage_id, d1.label) == (1, stage1.stage.label) and stage0.describe() is d0
        outs = omni.generate(["hello world", "hello world"], [params, params], lora_request=adapter)
        for out in outs:
            assert list(out.stage_outputs[0].outputs[0].token_ids) == hf_greedy(
                model, "hello world", N, tiny_llm_assets.adapter_a
            )
            assert out.prompt == out.stage_outputs[0].outputs[0].text
            assert out.token_ids == hf_greedy(model, out.prompt, N)
        assert omni.list_loras() == {1}
        # streaming through the actor: the pieces add up to the complete output
        pieces = []
        delta = SamplingParams(
            temperature=0.0, max_tokens=N, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        whole = stage1.submit(StageRequest(outs[0].prompt, delta, on_partial=pieces.append)).result(
            timeout=600
        )
        assert [t for p in pieces for t in p.outputs[0].token_ids] == list(whole.outputs[0].token_ids)
        assert list(whole.outputs[0].token_ids) == outs[0].token_ids
        assert pieces[-1].finished and len(pieces) > 1
        # issue 21 rule 1 through the actor: files rewritten at a registered path are a new version
        path = tmp_path / "v"
        shutil.copytree(tiny_llm_assets.adapter_a, path)
        v = LoRARequest("v", 5, str(path))
        assert omni.add_lora(v)
        (first,) = omni.generate(["hello world"], [params, params], lora_request=v)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(tiny_llm_assets.adapter_b / name, path / name)
        assert omni.add_lora(v, reload=True) is True
        (second,) = omni.generate(["hello world"], [params, params], lora_request=v)
        got = [list(o.stage_outputs[0].outputs[0].token_ids) for o in (first, second)]
        assert got[0] != got[1] and got == [
            hf_greedy(model, "hello world", N, tiny_llm_assets.adapter_a),
            hf_greedy(model, "hello world", N, tiny_llm_assets.adapter_b),
        ]
        assert omni.remove_lora(5)
        # issue 40: an adapter in memory crosses to the actor through Ray's object store, no file
        import json

        from safetensors.torch import load_file

        from vllm_omni.lora.request import TensorLoRARequest

        folder = tiny_llm_assets.adapter_b
        mem = TensorLoRARequest(
            lora_name="b_in_memory",
            lora_int_id=6,
            peft_config=json.loads((folder / "adapter_config.json").read_text()),
            lora_tensors=load_file(str(folder / "adapter_model.safetensors")),
        )
        (third,) = omni.generate(["hello world"], [params, params], lora_request=mem)
        assert list(third.stage_outputs[0].outputs[0].token_ids) == got[1]
    _assert_nothing_left()


def test_llm_to_diffusion_on_two_nodes_matches_inline_and_survives_actor_deaths(
    cluster, tiny_llm_assets, z_image_dir, tmp_path
):
    from vllm_omni import Omni
    from vllm_omni.engine.diffusion_stage import DiffusionStageEngine

    llm_dir = str(tiny_llm_assets.model_dir)
    deploy = tmp_path / "llm_to_diffusion.yaml"
    deploy.write_text(
        "pipeline: llm_to_diffusion\n"
        "worker_backend: ray\n"
        "stages:\n"
        f"  - stage_id: 0\n    model: {llm_dir}\n    enable_lora: true\n    max_lora_rank: 16\n"
        "    max_loras: 2\n    max_cpu_loras: 2\n    ray_resources: {node_a: 1}\n"
        "    engine_extras: {max_model_len: 256, dtype: float32}\n"
        f"  - stage_id: 1\n    model: {z_image_dir}\n    dtype: float32\n    enable_progress_bar: false\n"
        "    ray_resources: {node_b: 1}\n"
    )
    adapter = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    llm_params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    sp = OmniDiffusionSamplingParams(**DIFF)
    omni = Omni(deploy_config=str(deploy))
    try:
        llm_stage, diffusion_stage = omni._orchestrator.runtimes
        assert (llm_stage.info["node_id"], diffusion_stage.info["node_id"]) == _node_ids(cluster)
        (out,) = omni.generate("hello world", [llm_params, sp], lora_request=adapter)
        text = out.stage_outputs[0].outputs[0].text
        assert list(out.stage_outputs[0].outputs[0].token_ids) == hf_greedy(
            llm_dir, "hello world", N, tiny_llm_assets.adapter_a
        )
        inline = DiffusionStageEngine(omni.stage_configs[1])  # the same stage, in this process
        try:
            expected = inline.submit(StageRequest(text, sp)).result()
        finally:
            inline.shutdown()
        assert out.prompt == text and out.images[0].size == (32, 32)
        assert out.latents.equal(expected.latents)

        # node B goes away with a request in flight: it fails with StageDeadError naming the stage
        slow = diffusion_stage.submit(
            StageRequest(text, OmniDiffusionSamplingParams(**{**DIFF, "num_inference_steps": 2000}))
        )
        time.sleep(1.0)
        cluster.remove_node(next(iter(cluster.worker_nodes)))
        with pytest.raises(StageDeadError, match=r"Stage 1 \(diffusion\)"):
            slow.result(timeout=600)
        cluster.add_node(num_cpus=1, resources={"node_b": 1})  # somewhere to come back to
        _wait_recovered(diffusion_stage, 1)
        (again,) = omni.generate("hello world", [llm_params, sp], lora_request=adapter)
        assert again.latents.equal(expected.latents)

        # the LLM stage's actor is killed: it comes back with the adapters added and pinned at run time
        assert omni.add_lora(LoRARequest("b", 2, str(tiny_llm_assets.adapter_b)), stage_id=0)
        assert omni.pin_lora(2, stage_id=0)
        ray.kill(llm_stage.actor)
        with pytest.raises(StageDeadError, match=r"Stage 0 \(llm_ar\)"):
            omni.generate("hello world", [llm_params, sp], lora_request=adapter)
        assert omni.stage_health() == {0: "restarting", 1: "ready"}
        _wait_recovered(llm_stage, 1)
        assert omni.stage_health() == {0: "ready", 1: "ready"}
        # the run-time adapter is back; the request's adapter is loaded again by its next request
        assert omni.list_loras(stage_id=0) == {2}
        (third,) = omni.generate("hello world", [llm_params, sp], lora_request=adapter)
        assert third.latents.equal(expected.latents)
        assert omni.list_loras(stage_id=0) == {1, 2}
        _diffusion_tensors_reach_the_actor(omni, [llm_params, sp], adapter, z_image_dir, expected.latents)
    finally:
        omni.shutdown()
    _assert_nothing_left()


def _diffusion_tensors_reach_the_actor(omni, params, llm_adapter, z_image_dir, base_latents) -> None:
    """Issue 40 on a diffusion stage behind a Ray actor: an adapter handed over in memory (no file) serves
    the weights of its PEFT folder (equal latents; the folder's path equals diffusers+peft elsewhere), on
    stage 1 of the same request that gives stage 0 ``llm_adapter``."""
    import dataclasses
    import json

    from safetensors.torch import load_file

    from tools.make_tiny_diffusion_lora import ensure_tiny_z_image_loras
    from vllm_omni.lora.request import TensorLoRARequest

    folder = ensure_tiny_z_image_loras(z_image_dir, z_image_dir.parent)["attn"]
    mem = TensorLoRARequest(
        lora_name="attn_in_memory",
        lora_int_id=7,
        peft_config=json.loads((folder / "adapter_config.json").read_text()),
        lora_tensors=load_file(str(folder / "adapter_model.safetensors")),
    )
    by = {}
    for name, lora in (("file", LoRARequest("attn", 8, str(folder))), ("tensors", mem)):
        with_lora = [params[0], dataclasses.replace(params[1], lora_requests=[lora])]
        (out,) = omni.generate("hello world", with_lora, lora_request=llm_adapter)
        by[name] = out.latents
    assert (by["tensors"] - by["file"]).abs().max().item() <= 1e-5
    assert not by["file"].equal(base_latents)  # the adapter acted


def test_stage_no_node_can_host_fails_naming_the_stage_and_leaves_nothing(cluster, z_image_dir, monkeypatch):
    from vllm_omni import Omni
    from vllm_omni.engine.workers import ray_backend

    monkeypatch.setattr(ray_backend, "PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(
        StageEngineError, match=r"Stage 0 \(diffusion\): Ray cannot place the stage: .*node_c"
    ):
        Omni(model=str(z_image_dir), worker_backend="ray", ray_resources={"node_c": 1})
    _assert_nothing_left()


@pytest.mark.parametrize("bad", [["node_a"], {"node_a": -1}, {"node_a": True}, {1: 1}])
def test_ray_resources_must_map_names_to_amounts(z_image_dir, bad):
    from vllm_omni.entrypoints.omni_base import build_omni_config

    with pytest.raises(ConfigError, match="ray_resources must map Ray resource names to amounts"):
        build_omni_config(model=str(z_image_dir), worker_backend="ray", ray_resources=bad)


def test_ray_address_from_kwarg_or_deploy_yaml(z_image_dir, tmp_path):
    from vllm_omni.entrypoints.omni_base import build_omni_config

    assert build_omni_config(model=str(z_image_dir)).ray_address is None
    cfg = build_omni_config(model=str(z_image_dir), worker_backend="ray", ray_address="ray://head:10001")
    assert (cfg.worker_backend, cfg.ray_address) == ("ray", "ray://head:10001")
    deploy = tmp_path / "d.yaml"
    deploy.write_text(f"model: {z_image_dir}\nworker_backend: ray\nray_address: auto\n")
    assert build_omni_config(None, deploy_config=str(deploy)).ray_address == "auto"
    with pytest.raises(ConfigError, match="ray_address must be a string"):
        build_omni_config(model=str(z_image_dir), ray_address=6379)


def test_no_address_starts_a_local_cluster_never_one_found_on_the_machine(monkeypatch):
    """Without ``ray_address`` / ``RAY_ADDRESS`` the first runtime calls ``ray.init(address="local")``.

    Ray's default (``ray.init()`` without an address) attaches to the latest cluster started on the
    machine: in a CI run a pipeline of another test attached to this module's two-node cluster and
    queued its stage there, on CPUs the cluster's actors held (placement group left PENDING). With
    ``"local"`` Ray starts a new instance (Ray's ``ray.init`` docs, address resolution rule 4).
    """
    from vllm_omni.engine.workers import ray_backend

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray_backend, "_cluster", {"users": 0, "owned": False})
    ray_backend.connect()
    ray_backend.disconnect()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    ray_backend.connect()
    ray_backend.disconnect()
    assert calls == [
        {"address": "local", "include_dashboard": False},
        "shutdown",
        {"address": "10.0.0.1:6379"},
    ]
