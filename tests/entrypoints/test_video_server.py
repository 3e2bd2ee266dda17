"""`vllm-omni serve <tiny Wan>`: ``POST /v1/videos/generations`` (the in-tree Wan pipeline), over real HTTP.

The frames are checked against diffusers' ``WanPipeline`` run directly on the same
directory and seed (lossless ``video_format="png"``, uint8, within 2 levels); the
default container (MP4, or GIF without OpenCV) is checked for frame count and size.
Image-to-video (``tiny-wan-i2v-moe``, ``WanImageToVideoPipeline``): the first frame sent as a multipart
``input_reference`` file gives diffusers' frames for that image; the text-to-video server refuses the field.
"""

from __future__ import annotations

import base64
import io
import os
import tempfile

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.entrypoints.server_utils import (
    HTTP,
    REPO_ROOT,
    assert_openai_error,
    console_script,
    free_port,
    server_env,
    start_server,
)

PROMPT = "a red cat running on a mat"
GEN = {"num_inference_steps": 2, "guidance_scale": 3.0, "seed": 5, "num_frames": 5, "height": 32, "width": 48}
pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_wan_dir():
    from tools.make_tiny_wan import ensure_tiny_wan

    root = os.environ.get("VLLM_OMNI_TEST_ASSETS") or REPO_ROOT / ".cache" / "test_assets"
    return ensure_tiny_wan(root)


def _serve(model_dir, tmp_path_factory):
    port = free_port()
    cmd = console_script("vllm-omni") + [
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "wan",
        "--dtype",
        "float32",
        "--disable-uvicorn-access-log",
    ]
    log = tmp_path_factory.mktemp("serve_video_log") / "server.log"
    return start_server(cmd, port, log, server_env())


@pytest.fixture(scope="module")
def server(tiny_wan_dir, tmp_path_factory):
    srv = _serve(tiny_wan_dir, tmp_path_factory)
    yield srv
    srv.stop()


def post(server, body: dict) -> httpx.Response:
    return HTTP.post(server.url("/v1/videos/generations"), json=body, timeout=600)


def reference_frames(tiny_wan_dir, image=None) -> np.ndarray:
    """diffusers' frames ``(F, H, W, 3)`` int16: ``WanPipeline``, or ``WanImageToVideoPipeline`` of ``image``."""
    import torch

    if image is None:
        from diffusers import WanPipeline

        pipe = WanPipeline.from_pretrained(str(tiny_wan_dir), transformer_2=None)
        extra = {}
    else:
        from tests.diffusion.test_wan_in_tree_i2v import i2v_reference_class

        pipe = i2v_reference_class().from_pretrained(str(tiny_wan_dir))
        extra = {"image": image}
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        **extra,
        prompt=[PROMPT],
        num_frames=GEN["num_frames"],
        height=GEN["height"],
        width=GEN["width"],
        num_inference_steps=GEN["num_inference_steps"],
        guidance_scale=GEN["guidance_scale"],
        output_type="pil",
        generator=[torch.Generator().manual_seed(GEN["seed"])],
    )
    return np.stack([np.asarray(f.convert("RGB"), dtype=np.int16) for f in out.frames[0]])


def png_frames(item: dict) -> np.ndarray:
    return np.stack(
        [
            np.asarray(Image.open(io.BytesIO(base64.b64decode(f))).convert("RGB"), dtype=np.int16)
            for f in item["frames"]
        ]
    )


def decode_container(b64: str, fmt: str) -> list[np.ndarray]:
    data = base64.b64decode(b64)
    if fmt == "gif":
        img = Image.open(io.BytesIO(data))
        frames = []
        for i in range(img.n_frames):
            img.seek(i)
            frames.append(np.asarray(img.convert("RGB")))
        return frames
    import cv2

    assert fmt == "mp4" and data[4:8] == b"ftyp"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "v.mp4")
        with open(path, "wb") as f:
            f.write(data)
        cap = cv2.VideoCapture(path)
        frames = []
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            frames.append(frame)
        cap.release()
    return frames


def test_video_frames_match_diffusers(server, tiny_wan_dir):
    r = post(server, {"model": "wan", "prompt": PROMPT, "video_format": "png", **GEN})
    assert r.status_code == 200, r.text[:500]
    item = r.json()["data"][0]
    assert item["format"] == "png" and item["num_frames"] == GEN["num_frames"] == len(item["frames"])
    got = png_frames(item)
    assert got.shape == (GEN["num_frames"], GEN["height"], GEN["width"], 3)
    ref = reference_frames(tiny_wan_dir)
    assert ref.shape == got.shape
    assert np.abs(got - ref).max() <= 2
    assert got.std() > 1  # not a blank video


def test_video_container_decodes(server):
    r = post(server, {"prompt": PROMPT, "fps": 4, **GEN})
    assert r.status_code == 200, r.text[:500]
    item = r.json()["data"][0]
    assert item["format"] in ("mp4", "gif") and item["fps"] == 4 and item["num_frames"] == GEN["num_frames"]
    frames = decode_container(item["b64_json"], item["format"])
    assert len(frames) == GEN["num_frames"]
    assert all(f.shape[:2] == (GEN["height"], GEN["width"]) for f in frames)


def test_video_malformed_body(server):
    assert_openai_error(post(server, {"prompt": PROMPT, "num_frames": "many"}), statuses=(400,))
    assert_openai_error(post(server, {"prompt": PROMPT, "video_format": "avi"}), statuses=(400,))
    assert_openai_error(post(server, {"prompt": ""}), statuses=(400,))
    # a video pipeline has no image routes: a 400, never a 500
    err = assert_openai_error(
        HTTP.post(server.url("/v1/images/generations"), json={"prompt": PROMPT}, timeout=600),
        statuses=(400,),
    )
    assert "does not produce images" in err["message"]
    assert HTTP.get(server.url("/health")).status_code == 200


def test_text_to_video_refuses_an_input_reference(server):
    png = io.BytesIO()
    Image.new("RGB", (48, 32), "red").save(png, format="PNG")
    files = {"input_reference": ("first.png", png.getvalue(), "image/png")}
    fields = {"prompt": PROMPT, **{k: str(v) for k, v in GEN.items()}}
    r = HTTP.post(server.url("/v1/videos/generations"), data=fields, files=files, timeout=600)
    err = assert_openai_error(r, statuses=(400,))
    assert err["param"] == "input_reference" and "generates video from text only" in err["message"]


def test_image_to_video_from_an_input_reference_file_matches_diffusers(tmp_path_factory):
    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan

    model_dir = ensure_tiny_wan(test_assets_root(), moe=True, i2v=True)
    image = Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype("uint8"))
    png = io.BytesIO()
    image.save(png, format="PNG")
    fields = {"prompt": PROMPT, "video_format": "png", **{k: str(v) for k, v in GEN.items()}}
    srv = _serve(model_dir, tmp_path_factory)
    try:
        url = srv.url("/v1/videos/generations")
        r = HTTP.post(
            url, data=fields, files={"input_reference": ("f.png", png.getvalue(), "image/png")}, timeout=600
        )
        missing = HTTP.post(url, json={"prompt": PROMPT, **GEN}, timeout=600)
    finally:
        srv.stop()
    assert r.status_code == 200, r.text[:500]
    err = assert_openai_error(missing, statuses=(400,))
    assert err["param"] == "input_reference" and "input_reference is required" in err["message"]
    got = png_frames(r.json()["data"][0])
    ref = reference_frames(model_dir, image)
    assert got.shape == ref.shape == (GEN["num_frames"], GEN["height"], GEN["width"], 3)
    assert np.abs(got - ref).max() <= 2
