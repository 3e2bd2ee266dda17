"""Stage keys ``devices`` and ``replicas``: every input path, the checks, and what each worker sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_omni.engine.placement import apply_worker_env, device_groups, worker_env
from vllm_omni.entrypoints.omni_base import build_omni_config
from vllm_omni.errors import ConfigError


@pytest.fixture(scope="module")
def z_image():
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return str(ensure_tiny_diffusion_assets(test_assets_root())["z_image"])


@pytest.fixture(scope="module")
def llm(tiny_llm_assets):
    return str(tiny_llm_assets.model_dir)


def test_every_input_path_sets_them(llm, tmp_path):
    deploy = tmp_path / "d.yaml"
    deploy.write_text(
        "stages:\n  - stage_id: 0\n    devices: cuda:0,cuda:1\n    replicas: 2\n  - stage_id: 1\n"
    )
    cfg = build_omni_config(llm, pipeline="llm_chain", deploy_config=str(deploy))
    assert (cfg.stages[0].devices, cfg.stages[0].replicas) == (["cuda:0", "cuda:1"], 2)
    assert (cfg.stages[1].devices, cfg.stages[1].replicas) == (None, 1)
    cfg = build_omni_config(
        llm,
        pipeline="llm_chain",
        deploy_config=str(deploy),
        stage_overrides=json.dumps({"1": {"devices": ["cuda:3", "cuda:2"], "tensor_parallel_size": 2}}),
        stage_0_devices="cpu",
        stage_0_replicas=3,
    )
    assert (cfg.stages[0].devices, cfg.stages[0].replicas) == (["cpu"], 3)
    assert cfg.stages[1].devices == ["cuda:3", "cuda:2"]  # order kept: it decides the groups
    assert "devices" not in cfg.stages[0].options  # stage-level keys, not engine options


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"stage_0_devices": "gpu:0"},
            r"stage_0_devices, stage 0 \(llm_ar\): devices: unknown device name\(s\) \['gpu:0'\]",
        ),
        ({"stage_0_devices": "cuda"}, r"name the index: 'cuda:0'"),
        ({"stage_0_devices": "cuda:0,"}, "empty entry"),
        ({"stage_0_devices": 0}, "devices must be 'cpu', 'cuda:0'"),
        ({"stage_0_devices": ["cuda:1", "cuda:01"]}, r"lists \['cuda:1'\] more than once"),
        ({"stage_0_devices": "cpu,cuda:0"}, "mixes 'cpu' with CUDA devices"),
        (
            {"stage_0_replicas": 0},
            r"stage_0_replicas, stage 0 \(llm_ar\): replicas must be an integer >= 1, got int: 0",
        ),
        ({"stage_0_replicas": True}, "replicas must be an integer >= 1, got bool: True"),
        ({"stage_0_replicas": "2"}, "got str"),
        (
            {
                "stage_overrides": {"0": {"devices": "cuda:0,cuda:1"}},
                "stage_0_tensor_parallel_size": 2,
                "stage_0_replicas": 2,
            },
            r"stage_overrides and stage_0_replicas and stage_0_tensor_parallel_size, stage 0 \(llm_ar\): devices lists 2 "
            r"device\(s\) \['cuda:0', 'cuda:1'\], but the stage needs tensor_parallel_size \(2\) x replicas \(2\) = 4: "
            r"the devices are split in order into one group of 2 per replica",
        ),
        (
            {"stage_0_devices": "cuda:0", "stage_0_tensor_parallel_size": 2},
            r"tensor_parallel_size \(2\) x replicas \(1\) = 2",
        ),
        (
            {
                "stage_0_devices": "cuda:0,cuda:1",
                "stage_0_pipeline_parallel_size": 2,
                "stage_0_tensor_parallel_size": 2,
            },
            r"tensor_parallel_size \(2\) x pipeline_parallel_size \(2\) x replicas \(1\) = 4",
        ),
        (
            {"stage_0_devices": "cuda:0", "stage_0_tensor_parallel_size": "2"},
            "tensor_parallel_size must be an integer >= 1",
        ),
    ],
)
def test_llm_stage_errors_name_input_and_stage(llm, kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        build_omni_config(llm, pipeline="llm_chain", **kwargs)
    assert isinstance(info.value, ValueError)


def test_diffusion_stage_checks_its_parallel_size_and_device_option(z_image, tmp_path):
    cfg = build_omni_config(
        z_image, devices="cuda:0,cuda:1,cuda:2,cuda:3", tensor_parallel_size=2, replicas=2
    )
    assert device_groups(cfg.stages[0]) == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    with pytest.raises(
        ConfigError, match=r"keyword argument 'devices'.*tensor_parallel_size \(1\) x replicas \(2\) = 2"
    ):
        build_omni_config(z_image, devices="cuda:0", replicas=2)
    with pytest.raises(ConfigError, match=r"device='cuda' does not fit devices=\['cpu'\].*set it to 'cpu'"):
        build_omni_config(z_image, devices="cpu", device="cuda")
    deploy = tmp_path / "d.yaml"
    deploy.write_text("stages:\n  - stage_id: 0\n    replicas: 0\n")
    with pytest.raises(
        ConfigError, match=r"deploy config '.*d.yaml', stages\[0\], stage 0 \(diffusion\): replicas"
    ):
        build_omni_config(z_image, deploy_config=str(deploy))


def test_multi_stage_global_devices_apply_to_every_stage(llm):
    cfg = build_omni_config(llm, pipeline="llm_chain", devices="cpu", replicas=2)
    assert [(s.devices, s.replicas) for s in cfg.stages] == [(["cpu"], 2), (["cpu"], 2)]


def test_worker_env_per_replica(llm):
    cfg = build_omni_config(
        llm,
        pipeline="llm_chain",
        stage_0_devices="cuda:4,cuda:5,cuda:6,cuda:7",
        stage_0_tensor_parallel_size=2,
        stage_0_replicas=2,
        stage_1_devices="cpu",
        stage_1_replicas=2,
    )
    s0, s1 = cfg.stages
    assert [worker_env(s0, i) for i in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "4,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]
    assert [worker_env(s1, i) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": ""}] * 2
    plain = build_omni_config(llm, pipeline="llm_chain").stages[0]
    assert device_groups(plain) == [] and worker_env(plain, 0) == {}
    with pytest.raises(IndexError, match="no replica 2"):
        worker_env(s0, 2)


_PROBE = """
import os, sys, json
from vllm_omni.engine.placement import apply_worker_env
assert "torch" not in sys.modules, "placement must be importable before torch"
apply_worker_env(json.loads(sys.argv[1]))
import torch
print(json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda": torch.cuda.device_count()}))
"""


def test_each_worker_sees_only_its_devices(llm):
    """A child that applies its replica's env before importing torch sees exactly that (on CPU: no CUDA)."""
    cfg = build_omni_config(
        llm, pipeline="llm_chain", stage_0_devices="cuda:2,cuda:3", stage_0_replicas=2, stage_1_devices="cpu"
    )
    seen = []
    for stage, index in [(cfg.stages[0], 0), (cfg.stages[0], 1), (cfg.stages[1], 0)]:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, json.dumps(worker_env(stage, index))],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=True,
        )
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert [s["visible"] for s in seen] == ["2", "3", ""]
    assert all(s["cuda"] == 0 for s in seen)  # this machine has no GPU; with one, "2" would be cuda:0


def test_apply_worker_env_sets_the_variables(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    apply_worker_env({"CUDA_VISIBLE_DEVICES": "1"})
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
