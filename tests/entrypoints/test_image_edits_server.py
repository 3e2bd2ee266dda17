"""`/v1/images/edits` end to end on an image-to-image pipeline (tiny SD3 img2img, diffusers fallback).

The tiny SD3 directory is reused with ``_class_name`` set to ``StableDiffusion3Img2ImgPipeline``
(same components). The edited image must equal diffusers' own img2img pipeline on the same input.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import openai
import pytest
from PIL import Image

from tests.entrypoints.server_utils import HTTP, console_script, free_port, server_env, start_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]
SIZE = 32
API_KEY = "test-key"
GEN = {"num_inference_steps": 4, "guidance_scale": 1.0, "seed": 3}  # 2 steps: output ignores the input


@pytest.fixture(scope="module")
def img2img_dir(tiny_z_image_dir, tmp_path_factory):
    sd3 = tiny_z_image_dir.parent / "tiny-sd3"
    out = tmp_path_factory.mktemp("sd3_img2img")
    for child in sd3.iterdir():
        if child.is_dir():
            (out / child.name).symlink_to(child, target_is_directory=True)
    index = json.loads((sd3 / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusion3Img2ImgPipeline"
    (out / "model_index.json").write_text(json.dumps(index))
    return out


@pytest.fixture(scope="module")
def client(img2img_dir, tmp_path_factory):
    port = free_port()
    cmd = console_script("vllm-omni") + [
        "serve",
        str(img2img_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    cmd += ["--dtype", "float32", "--served-model-name", "sd3-edit", "--disable-uvicorn-access-log"]
    cmd += ["--api-key", API_KEY]
    srv = start_server(cmd, port, tmp_path_factory.mktemp("edit_log") / "server.log", server_env())
    yield openai.OpenAI(base_url=srv.url("/v1"), api_key=API_KEY, max_retries=0, timeout=600)
    srv.stop()


def png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (SIZE, SIZE), color).save(buf, format="PNG")
    return buf.getvalue()


def edit(client, color) -> np.ndarray:
    result = client.images.edit(
        image=("in.png", png(color), "image/png"),
        prompt="a cat",
        size=f"{SIZE}x{SIZE}",
        response_format="b64_json",
        extra_body=GEN,
    )
    return np.asarray(
        Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"), np.int16
    )


def reference(img2img_dir, color) -> np.ndarray:
    import torch
    from diffusers import StableDiffusion3Img2ImgPipeline

    pipe = StableDiffusion3Img2ImgPipeline.from_pretrained(
        str(img2img_dir), text_encoder_3=None, tokenizer_3=None
    )
    pipe.set_progress_bar_config(disable=True)
    image = Image.open(io.BytesIO(png(color))).convert("RGB")
    with torch.no_grad():
        out = pipe(
            prompt="a cat",
            image=image,
            height=SIZE,
            width=SIZE,
            num_inference_steps=GEN["num_inference_steps"],
            guidance_scale=GEN["guidance_scale"],
            generator=[torch.Generator().manual_seed(GEN["seed"])],
        ).images[0]
    return np.asarray(out.convert("RGB"), np.int16)


def test_edit_uses_the_input_image_like_diffusers(client, img2img_dir):
    red, blue = edit(client, (200, 30, 30)), edit(client, (30, 30, 200))
    assert red.shape == (SIZE, SIZE, 3)
    assert int(np.abs(red - reference(img2img_dir, (200, 30, 30))).max()) <= 2
    assert int(np.abs(red - blue).max()) > 8  # the input image matters


def test_edit_with_a_bad_lora_field_is_a_400(client):
    with pytest.raises(openai.BadRequestError):
        client.images.edit(
            image=("in.png", png((1, 2, 3)), "image/png"), prompt="x", extra_body={"lora": "[{"}
        )


def test_api_key_guards_v1_routes(client):
    base = str(client.base_url).rstrip("/")
    assert HTTP.get(base.removesuffix("/v1") + "/health").status_code == 200
    assert HTTP.get(base + "/models").status_code == 401
    assert HTTP.get(base + "/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = HTTP.get(base + "/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "sd3-edit"
    # every /v1 route, before its body is looked at (no key, a wrong key, a key without "Bearer")
    routes = [
        "/chat/completions",
        "/completions",
        "/images/generations",
        "/images/edits",
        "/videos/generations",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    ]
    for route in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY + "x"}):
            r = HTTP.post(base + route, json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", route
