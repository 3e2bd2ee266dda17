"""The HTTP layer decides what a pipeline answers from what its stages describe, never from a
class name: the same Z-Image config served by a stand-in engine whose stage says it makes images,
then video, then takes an input image, gets the routes' answers that follow each description.

The stand-in engine runs nothing; it records the requests that reached it.
"""

from __future__ import annotations

import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from tests.lora.fake_stages import FakeStages
from vllm_omni.engine.protocols import AdapterCapabilities, StageDescription
from vllm_omni.entrypoints.omni_base import build_omni_config
from vllm_omni.entrypoints.openai.api_server import build_app
from vllm_omni.entrypoints.openai.settings import ServerSettings
from vllm_omni.entrypoints.openai.state import make_state
from vllm_omni.entrypoints.stage_info import describe_entry_stage
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.lora.registry import AdapterRegistry


class _Engine:
    """What the routes read of ``AsyncOmni`` before a request runs: ``entry_stage_info``."""

    def __init__(self, info):
        self.entry_stage_info = info
        self.adapter_registry = AdapterRegistry(FakeStages().call)  # no adapters registered
        self.ran: list[str] = []

    async def generate(self, prompt, *args, **kwargs):
        self.ran.append(prompt)
        raise RuntimeError("the stand-in engine runs nothing")
        yield  # an async generator, as AsyncOmni.generate


@pytest.fixture(scope="module")
def z_image_config():
    from tests.conftest import test_assets_root
    from tools.make_tiny_diffusion import ensure_tiny_diffusion_assets

    return build_omni_config(str(ensure_tiny_diffusion_assets(test_assets_root())["z_image"]))


def _client(config, kind: str, inputs=("text",)) -> tuple[TestClient, _Engine]:
    described = StageDescription(
        0, "Stage 0", kind, frozenset(inputs), OmniDiffusionSamplingParams,
        adapters=AdapterCapabilities("diffusion", 1, 1, 64, ("transformer",)),
    )  # fmt: skip
    info = describe_entry_stage(config, [described])
    assert info.model_arch == "ZImagePipeline"  # a name that says nothing about video
    engine = _Engine(info)
    app = build_app(make_state(engine, ServerSettings(served_model_names=["m"])))
    return TestClient(app, raise_server_exceptions=False), engine


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, format="PNG")
    return buf.getvalue()


def test_a_stage_that_describes_video_serves_no_images(z_image_config):
    client, engine = _client(z_image_config, "video")
    reply = client.post("/v1/images/generations", json={"prompt": "a cat", "model": "m"})
    assert reply.status_code == 400 and "does not produce images" in reply.json()["error"]["message"]
    assert engine.ran == []


def test_a_stage_that_describes_images_serves_no_video(z_image_config):
    client, engine = _client(z_image_config, "image")
    reply = client.post("/v1/videos/generations", json={"prompt": "a cat", "model": "m"})
    assert reply.status_code == 400 and "does not produce video" in reply.json()["error"]["message"]
    reply = client.post("/v1/images/generations", json={"prompt": "a dog", "model": "m"})
    assert engine.ran == ["a dog"], reply.text  # images: past every check, into the engine


def test_edits_need_a_stage_that_describes_an_image_input(z_image_config):
    files = {"image": ("in.png", _png(), "image/png")}
    client, engine = _client(z_image_config, "image")
    reply = client.post("/v1/images/edits", data={"prompt": "a cat", "model": "m"}, files=files)
    assert reply.status_code == 400 and "generates from text only" in reply.json()["error"]["message"]
    assert engine.ran == []
    # the same config, a stage that says it takes an image: the request reaches the engine
    client, engine = _client(z_image_config, "image", ("text", "image"))
    reply = client.post("/v1/images/edits", data={"prompt": "a cat", "model": "m"}, files=files)
    assert engine.ran == ["a cat"], reply.text
