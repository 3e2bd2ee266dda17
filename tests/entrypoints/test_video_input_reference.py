"""``POST /v1/videos/generations`` with ``input_reference`` (OpenAI's ``POST /v1/videos`` name for the first
frame), routed by what the entry stage describes: a stage that takes an image gets the decoded image as
``extra_args["image"]`` from a multipart file or a JSON base64 / data URI field, and a request without one
is a 400 naming the field; a text-to-video stage refuses the field by name. A stand-in engine records what
reaches it (nothing runs); the real servers: ``test_video_server`` (text-to-video refusal) and
``test_wan_in_tree_i2v`` (frames against diffusers)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests.entrypoints.test_routes_read_descriptions import _Engine, _png
from vllm_omni.engine.protocols import AdapterCapabilities, StageDescription
from vllm_omni.entrypoints.omni_base import build_omni_config
from vllm_omni.entrypoints.openai.api_server import build_app
from vllm_omni.entrypoints.openai.settings import ServerSettings
from vllm_omni.entrypoints.openai.state import make_state
from vllm_omni.entrypoints.stage_info import describe_entry_stage
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@pytest.fixture(scope="module")
def config():
    """The tiny Z-Image config: a stand-in stage description says what it takes and makes."""
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return build_omni_config(str(ensure_tiny_diffusion_assets(test_assets_root())["z_image"]))


class _Recorder(_Engine):
    """Records the diffusion params of each request that reaches it (then fails, running nothing)."""

    def __init__(self, info):
        super().__init__(info)
        self.params: list[OmniDiffusionSamplingParams] = []

    async def generate(self, prompt, params, *args, **kwargs):
        self.params += [p for p in params if isinstance(p, OmniDiffusionSamplingParams)]
        raise RuntimeError("the stand-in engine runs nothing")
        yield  # an async generator, as AsyncOmni.generate


def _video_client(config, inputs, image_optional: bool = False) -> tuple[TestClient, _Recorder]:
    described = StageDescription(
        0, "Stage 0", "video", frozenset(inputs), OmniDiffusionSamplingParams,
        adapters=AdapterCapabilities("diffusion", 1, 1, 64, ("transformer",)), image_optional=image_optional,
    )  # fmt: skip
    engine = _Recorder(describe_entry_stage(config, [described]))
    app = build_app(make_state(engine, ServerSettings(served_model_names=["m"])))
    return TestClient(app, raise_server_exceptions=False), engine


def _error(reply) -> dict:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def test_an_image_to_video_stage_gets_input_reference_from_a_file_or_base64(config):
    client, engine = _video_client(config, ("text", "image"))
    png = _png()  # 32x32 red
    body = {"prompt": "a cat", "model": "m", "num_frames": "5"}
    client.post("/v1/videos/generations", data=body, files={"input_reference": ("f.png", png, "image/png")})
    b64 = base64.b64encode(png).decode()
    for ref in (b64, "data:image/png;base64," + b64):
        client.post("/v1/videos/generations", json={**body, "input_reference": ref})
    assert len(engine.params) == 3
    for params in engine.params:
        image = params.extra_args["image"]
        assert image.size == (32, 32) and np.asarray(image)[0, 0].tolist() == [255, 0, 0]
        assert params.extra_args["num_frames"] == 5
    err = _error(client.post("/v1/videos/generations", json=body))
    assert err["param"] == "input_reference" and "input_reference is required" in err["message"]
    for bad in ("not base64!", "data:text/plain;base64,aGk=", base64.b64encode(b"not an image").decode()):
        assert (
            _error(client.post("/v1/videos/generations", json={**body, "input_reference": bad}))["param"]
            == "input_reference"
        )
    assert len(engine.params) == 3  # no refused request reached the engine


def test_a_text_to_video_stage_refuses_input_reference_by_name(config):
    client, engine = _video_client(config, ("text",))
    files = {"input_reference": ("f.png", _png(), "image/png")}
    err = _error(client.post("/v1/videos/generations", data={"prompt": "a cat"}, files=files))
    assert err["param"] == "input_reference" and "generates video from text only" in err["message"]
    assert engine.params == []


def test_a_stage_whose_image_is_optional_takes_requests_with_and_without_input_reference(config):
    """Wan2.2 TI2V-5B (``WanPipeline`` with ``expand_timesteps``): text-to-video without the field, image-to-video
    with it, from one stage (the real pipeline: ``tests/diffusion/test_wan_in_tree_ti2v.py``)."""
    client, engine = _video_client(config, ("text", "image"), image_optional=True)
    body = {"prompt": "a cat", "model": "m", "num_frames": 5}
    client.post("/v1/videos/generations", json=body)
    client.post("/v1/videos/generations", json={**body, "input_reference": base64.b64encode(_png()).decode()})
    assert [sorted(p.extra_args) for p in engine.params] == [["num_frames"], ["image", "num_frames"]]
    assert engine.params[1].extra_args["image"].size == (32, 32)
