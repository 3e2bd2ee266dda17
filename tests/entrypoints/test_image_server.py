"""`vllm-omni serve <tiny Z-Image>`: image routes with request-time adapters, over real HTTP.

One server for the module, started through the ``vllm-omni`` console script. Images are
checked against diffusers' ``ZImagePipeline`` carrying the same PEFT adapters (peft), on
the decoded PNG pixels (uint8, within 2 levels).
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from PIL import Image

from tests.entrypoints.server_utils import (
    HTTP,
    REPO_ROOT,
    assert_openai_error,
    copy_adapter,
    decode_png,
    free_port,
    input_audio_part,
    serve_command,
    server_env,
    start_server,
)

GEN = {"num_inference_steps": 2, "guidance_scale": 3.0, "seed": 5}
SIZE = 32
PROMPT = "a red cat on a mat"
pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="session")
def z_loras(tiny_z_image_dir):
    from tools.make_tiny_diffusion_lora import ensure_tiny_z_image_loras

    return ensure_tiny_z_image_loras(tiny_z_image_dir, tiny_z_image_dir.parent)


@pytest.fixture(scope="module")
def paths(z_loras, tiny_z_image_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_img") / "loras"
    root.mkdir()
    (root / "pickled.bin").write_bytes(b"\x80\x04")
    from tools.lora_layouts import write_lycoris
    from tools.make_tiny_diffusion_lora import build_lycoris_adapter

    targets = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
    folder = tiny_z_image_dir / "transformer"
    lyco = tmp_path_factory.mktemp("serve_img_lycoris")
    loha = build_lycoris_adapter(folder, root / "loha", "loha", 301, targets, r=4, alpha=6.0)
    lokr = build_lycoris_adapter(
        folder, lyco / "lokr", "lokr", 302, targets, r=2, alpha=3.0, decompose_factor=4
    )
    return {
        "loha": loha,
        "lokr_peft": lokr,
        "lokr_file": write_lycoris(str(lokr), str(root / "lokr.safetensors")),
        "root": root,
        "attn": copy_adapter(z_loras["attn"], root / "attn"),
        "qv": copy_adapter(z_loras["qv"], root / "qv"),
        "ff": z_loras["ff"],  # outside the root: registered at start-up with --lora-path
        "pickled": root / "pickled.bin",
    }


@pytest.fixture(scope="module")
def server(tiny_z_image_dir, paths, tmp_path_factory):
    port = free_port()
    cmd = serve_command(
        str(tiny_z_image_dir),
        port,
        "--served-model-name",
        "z-image",
        "--dtype",
        "float32",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "4",
        "--lora-path",
        str(paths["ff"]),
        "--lora-dirs",
        str(paths["root"]),
        "--prompt-lora-syntax",
    )
    log = tmp_path_factory.mktemp("serve_img_log") / "server.log"
    srv = start_server(cmd, port, log, server_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=600)


decode = decode_png


def lora_list(paths, *entries):
    return [
        {"name": key, "path": str(paths[key]), **({"scale": s} if s is not None else {})}
        for key, s in entries
    ]


def generate(client, lora=None, model="z-image", prompt=PROMPT) -> np.ndarray:
    extra = dict(GEN)
    if lora is not None:
        extra["lora"] = lora
    result = client.images.generate(
        model=model, prompt=prompt, n=1, size=f"{SIZE}x{SIZE}", response_format="b64_json", extra_body=extra
    )
    assert len(result.data) == 1
    return decode(result.data[0].b64_json)


_REF: dict = {}


def reference(tiny_z_image_dir, adapters=(), merged: bool = False) -> np.ndarray:
    """diffusers + peft image for ``adapters`` = ((peft_dir, scale), ...); ``merged``: peft's merged updates
    (:func:`~tests.diffusion.lora_oracle.merged_reference_pipeline`, for LoHa / LoKr)."""
    key = (tuple((str(p), s) for p, s in adapters), merged)
    if key not in _REF:
        from tests.diffusion.lora_oracle import merged_reference_pipeline, reference_pipeline

        pipe = (merged_reference_pipeline if merged else reference_pipeline)(tiny_z_image_dir, list(adapters))
        _REF[key] = render(pipe)
    return _REF[key]


def render(pipe) -> np.ndarray:
    """The diffusers pipeline's image for ``PROMPT`` with this module's settings (uint8 pixels as int16)."""
    import torch

    with torch.no_grad():
        image = pipe(
            PROMPT,
            num_inference_steps=GEN["num_inference_steps"],
            guidance_scale=GEN["guidance_scale"],
            generator=torch.Generator().manual_seed(GEN["seed"]),
            height=SIZE,
            width=SIZE,
        ).images[0]
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def close(a: np.ndarray, b: np.ndarray, levels: int = 2) -> bool:
    return a.shape == b.shape and int(np.abs(a - b).max()) <= levels


def test_models_list_base_and_startup_adapter(client):
    models = {m.id: m.parent for m in client.models.list().data}
    assert models == {"z-image": None, "ff": "z-image"}


@pytest.mark.parametrize("entries", [(), (("attn", 0.5),), (("attn", None), ("qv", 0.5))])
def test_images_generate_matches_diffusers_peft(client, paths, tiny_z_image_dir, entries):
    got = generate(client, lora=lora_list(paths, *entries) if entries else None)
    want = reference(tiny_z_image_dir, [(paths[k], 1.0 if s is None else s) for k, s in entries])
    assert close(got, want), int(np.abs(got - want).max())
    if entries:
        assert not close(got, reference(tiny_z_image_dir), 8)  # the adapters really act


def test_loha_and_lokr_file_with_lora_match_diffusers_peft(client, paths, tiny_z_image_dir):
    got = generate(client, lora=lora_list(paths, ("loha", 0.8), ("attn", 0.5)))
    expected = reference(tiny_z_image_dir, [(paths["loha"], 0.8), (paths["attn"], 0.5)], merged=True)
    assert close(got, expected) and not close(got, reference(tiny_z_image_dir), 8)
    got = generate(client, lora=lora_list(paths, ("lokr_file", 1.2)))
    assert close(got, reference(tiny_z_image_dir, [(paths["lokr_peft"], 1.2)], merged=True))


def test_single_object_lora_and_chat_image_reply(client, server, paths):
    via_images = generate(client, lora={"lora_name": "attn", "local_path": str(paths["attn"]), "scale": 0.5})
    reply = client.chat.completions.create(
        model="z-image",
        messages=[{"role": "user", "content": PROMPT}],
        extra_body={**GEN, "height": SIZE, "width": SIZE, "lora": lora_list(paths, ("attn", 0.5))},
    )
    part = reply.choices[0].message.content[0]
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/png;base64,")
    assert close(decode(part["image_url"]["url"].split(",", 1)[1]), via_images, 0)


@pytest.mark.parametrize("fmt, pil_format", [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_output_format_encodes_the_diffusers_image(client, tiny_z_image_dir, fmt, pil_format):
    """Issue 49: ``output_format`` jpeg / webp (``output_compression`` 95): that file format, and the
    pixels of the reference image (diffusers, no adapter) encoded by the same codec (Pillow, quality 95)."""
    result = client.images.generate(
        model="z-image",
        prompt=PROMPT,
        n=1,
        size=f"{SIZE}x{SIZE}",
        output_format=fmt,
        output_compression=95,
        extra_body=dict(GEN),
    )
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert image.format == pil_format and image.size == (SIZE, SIZE)
    got = np.asarray(image.convert("RGB"), dtype=np.int16)
    buf = io.BytesIO()  # the reference image through the same codec at the same quality
    Image.fromarray(reference(tiny_z_image_dir).astype(np.uint8)).save(buf, format=pil_format, quality=95)
    want = np.asarray(Image.open(buf).convert("RGB"), dtype=np.int16)
    assert np.abs(got - want).mean() < 2, np.abs(got - want).mean()


def test_text_only_fields_on_an_image_pipeline_are_400_naming_them(server):
    """Issue 49: logprobs, response_format and tools are not silently ignored by an image pipeline;
    /tokenize needs an LLM entry stage; an unknown output_format and a side the model cannot reach
    are refused naming the field."""
    chat = {"messages": [{"role": "user", "content": PROMPT}]}
    for field, value in (
        ("logprobs", True),
        ("response_format", {"type": "json_object"}),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ):
        r = HTTP.post(server.url("/v1/chat/completions"), json=chat | {field: value})
        assert assert_openai_error(r, (400,))["param"] == field
    body = {"prompt": PROMPT, "output_format": "bmp"}
    r = HTTP.post(server.url("/v1/images/generations"), json=body)
    assert assert_openai_error(r, (400,))["param"] == "output_format"
    # a side beyond the model's positional tables names the field the request set it with
    for sides, param in (({"size": "4096x4096"}, "size"), ({"height": 4096, "width": 64}, "height")):
        r = HTTP.post(server.url("/v1/images/generations"), json={"prompt": PROMPT, **sides})
        err = assert_openai_error(r, (400,))
        assert err["param"] == param and "exceeds this model's maximum" in err["message"], err
    assert_openai_error(HTTP.post(server.url("/tokenize"), json={"prompt": "x"}), (400,))


def test_input_audio_to_an_image_pipeline_is_400_naming_the_part(server):
    messages = [
        {"role": "user", "content": [input_audio_part([0.1] * 1600), {"type": "text", "text": PROMPT}]}
    ]
    err = assert_openai_error(
        HTTP.post(server.url("/v1/chat/completions"), json={"messages": messages}, timeout=600), (400,)
    )
    assert err["param"] == "messages[0].content[0]" and "takes no audio input" in err["message"]


def test_peer_spellings_give_byte_identical_images(client, paths):
    """vllm-omni's ``adapter`` / ``lora_scale`` and ComfyUI / A1111's ``strength`` / ``weight`` are the
    canonical ``name`` / ``scale``: the same PNG bytes; a misspelt key is a 400 that names the right one."""
    attn = str(paths["attn"])
    canonical = generate(
        client, lora=[{"name": "attn", "path": attn, "scale": 0.5}, {"name": "ff", "scale": 0.7}]
    )
    peers = [
        [{"adapter": "attn", "local_path": attn, "lora_scale": 0.5}, {"adapter": "ff", "lora_scale": 0.7}],
        [{"lora_name": "attn", "path": attn, "strength": 0.5}, {"name": "ff", "weight": 0.7}],
    ]
    for lora in peers:
        assert np.array_equal(generate(client, lora=lora), canonical), lora
    assert not np.array_equal(canonical, generate(client, lora=[{"name": "ff", "scale": 0.7}]))
    with pytest.raises(openai.BadRequestError) as info:
        generate(client, lora={"adapter": "attn", "path": attn, "strenght": 0.5})
    assert "'strenght' (did you mean 'strength'?)" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        generate(client, lora={"adapter": "ff", "scale": {}})
    assert "lora.scale is an empty schedule" in str(info.value)


@pytest.fixture(scope="module")
def te_files(tiny_z_image_dir, z_loras, paths):
    """Files with a denoiser and a text-encoder part, inside ``--lora-dirs`` (kohya and diffusers layouts)."""
    from tests.diffusion.lora_oracle import text_encoder_lora_files

    folder = paths["root"] / "with_text_encoder"
    folder.mkdir(exist_ok=True)
    return text_encoder_lora_files(tiny_z_image_dir, z_loras, folder, ["q_proj", "v_proj"], 4, 8.0)


def test_text_encoder_parts_and_their_scale_over_http(client, te_files, tiny_z_image_dir):
    """Issue 35 item 3 over HTTP: a kohya file's encoder part applies at ``text_encoder_scale`` (ComfyUI's
    ``strength_clip`` gives the same PNG bytes), its denoiser part at ``scale``: equal to diffusers'
    ``ZImagePipeline`` with the denoiser part through peft at 0.8 and the encoder replaced by
    transformers+peft at 1.5; the diffusers-keyed file gives the same image."""

    from tests.diffusion.lora_oracle import peft_scaled, reference_pipeline

    _, peft_te, files = te_files
    kohya = {"path": str(files["kohya"]), "scale": 0.8}
    got = generate(client, lora=[{**kohya, "text_encoder_scale": 1.5}])
    assert np.array_equal(generate(client, lora=[{**kohya, "strength_clip": 1.5}]), got)
    diffusers_keyed = generate(
        client, lora=[{"path": str(files["diffusers"]), "scale": 0.8, "text_encoder_scale": 1.5}]
    )
    assert close(diffusers_keyed, got, 1)
    pipe = reference_pipeline(tiny_z_image_dir, [(files["denoiser"], 0.8)])
    pipe.text_encoder = peft_scaled(peft_te, 1.5)
    want = render(pipe)
    assert close(got, want), int(np.abs(got - want).max())
    assert not close(
        generate(client, lora=[{**kohya, "text_encoder_scale": 0.0}]), want
    )  # the encoder part acts


def test_a1111_prompt_tokens_select_registered_adapters(client):
    """``--prompt-lora-syntax``: ``<lora:ff:0.7>`` in the prompt is ``lora={"name": "ff", "scale": 0.7}``
    on the prompt without the token (the same PNG bytes); an unknown name is a 404, a bad weight a 400."""
    by_field = generate(client, lora=[{"name": "ff", "scale": 0.7}])
    assert np.array_equal(generate(client, prompt="a red cat <lora:ff:0.7> on a mat"), by_field)
    assert not np.array_equal(generate(client, prompt=f"{PROMPT} <lora:ff:0.3>"), by_field)
    with pytest.raises(openai.NotFoundError):
        generate(client, prompt=f"{PROMPT} <lora:no-such-adapter:1>")
    with pytest.raises(openai.BadRequestError, match="the weight must be a number"):
        generate(client, prompt=f"{PROMPT} <lora:ff:strong>")


def test_model_field_selects_the_startup_adapter(client, paths, tiny_z_image_dir):
    by_model = generate(client, model="ff")
    by_path = generate(client, lora=[{"name": "ff", "path": str(paths["ff"])}])
    assert close(by_model, by_path, 0)
    assert close(by_model, reference(tiny_z_image_dir, [(paths["ff"], 1.0)]))
    with pytest.raises(openai.NotFoundError):
        generate(client, model="no-such-model")


def _block_multiplier(name: str) -> float:
    return 0.0 if name.startswith("layers.1.") else 2.0 if name.startswith("noise_refiner.") else 1.0


def test_scale_schedules_match_diffusers_step_callback(server, client, paths, tiny_z_image_dir):
    import torch

    from tests.diffusion.lora_oracle import scheduled_reference_pipeline

    steps = GEN["num_inference_steps"]
    scale = {"steps": [1.5, -0.5], "blocks": {"layers.1": 0.0, "noise_refiner": 2.0}}
    got = generate(client, lora=[{"name": "attn", "path": str(paths["attn"]), "scale": scale}])
    pipe, callback = scheduled_reference_pipeline(
        tiny_z_image_dir, [(paths["attn"], [1.5, -0.5], _block_multiplier)], steps
    )
    with torch.no_grad():
        image = pipe(
            PROMPT,
            num_inference_steps=steps,
            guidance_scale=GEN["guidance_scale"],
            generator=torch.Generator().manual_seed(GEN["seed"]),
            height=SIZE,
            width=SIZE,
            callback_on_step_end=callback,
        ).images[0]
    want = np.asarray(image.convert("RGB"), dtype=np.int16)
    assert close(got, want), int(np.abs(got - want).max())
    assert not close(got, generate(client, lora=lora_list(paths, ("attn", 1.5))), 8)  # the schedule acts
    url = server.url("/v1/images/generations")
    body = {"prompt": PROMPT, "size": f"{SIZE}x{SIZE}", **GEN}
    for bad, words in (
        ([1.0, 0.5, 0.2], ["lora[0].scale", "3 per-step values", "num_inference_steps is 2", "'attn'"]),
        ([{"start": 0, "end": 0.5, "scale": 1}], ["lora[0].scale", "cover [0, 1]", "'attn'"]),
        (
            {"blocks": {"single_blocks.*": 0.5}},
            ["blocks pattern 'single_blocks.*' matches no LoRA layer", "'attn'"],
        ),
    ):
        r = HTTP.post(
            url, json={**body, "lora": [{"name": "attn", "path": str(paths["attn"]), "scale": bad}]}
        )
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert all(w in message for w in words), message


def test_concurrent_requests_with_different_adapter_sets(client, paths):
    plans = [(), (("attn", 1.0),), (("qv", 1.0),), (("attn", 0.5), ("qv", 2.0)), (), (("attn", 1.0),)]
    solo = {p: generate(client, lora=lora_list(paths, *p) or None) for p in set(plans)}
    with ThreadPoolExecutor(len(plans)) as pool:
        results = list(pool.map(lambda p: generate(client, lora=lora_list(paths, *p) or None), plans))
    for plan, got in zip(plans, results):
        assert close(got, solo[plan]), plan
    assert not close(solo[(("attn", 1.0),)], solo[(("qv", 1.0),)], 8)


def test_runtime_load_and_unload_reach_the_diffusion_stage(server, client, paths):
    r = HTTP.post(
        server.url("/v1/load_lora_adapter"), json={"lora_name": "qv-rt", "lora_path": str(paths["qv"])}
    )
    assert r.status_code == 200, r.text
    assert {m.id: m.parent for m in client.models.list().data}["qv-rt"] == "z-image"
    assert close(generate(client, model="qv-rt"), generate(client, lora=lora_list(paths, ("qv", None))), 0)
    assert HTTP.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "qv-rt"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        generate(client, model="qv-rt")


def test_a_folder_swapped_for_a_symlink_out_is_refused_at_every_read(server, client, paths):
    """Issue 35 rule 5 over HTTP: an adapter loaded from inside --lora-dirs whose folder is then replaced
    by a symlink leading out is refused on reload (load_inplace) and on a request naming it (its files
    would be read), naming the folder; it stays listed, and serves the same image once the files are back."""
    import shutil

    folder = copy_adapter(paths["qv"], paths["root"] / "swapped")
    r = HTTP.post(
        server.url("/v1/load_lora_adapter"), json={"lora_name": "swapped", "lora_path": str(folder)}
    )
    assert r.status_code == 200, r.text
    before = generate(client, model="swapped")
    shutil.move(folder, paths["root"].parent / "swapped_aside")
    outside = copy_adapter(paths["attn"], paths["root"].parent / "outside_attn")  # not in --lora-dirs
    folder.symlink_to(outside, target_is_directory=True)
    try:
        body = {"lora_name": "swapped", "lora_path": str(folder), "load_inplace": True}
        assert (
            str(folder)
            in assert_openai_error(HTTP.post(server.url("/v1/load_lora_adapter"), json=body))["message"]
        )
        with pytest.raises(openai.BadRequestError) as info:
            generate(client, model="swapped")
        assert str(folder) in str(info.value) and "--lora-dirs" in str(info.value)
        assert "swapped" in {m.id for m in client.models.list().data}
    finally:
        folder.unlink()
        shutil.move(paths["root"].parent / "swapped_aside", folder)
    assert close(generate(client, model="swapped"), before, 0)
    assert HTTP.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "swapped"}).status_code == 200


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (SIZE, SIZE), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_edits_multipart_validation(server, client, paths):
    url = server.url("/v1/images/edits")
    form = {"prompt": PROMPT, "size": f"{SIZE}x{SIZE}", "num_inference_steps": "2"}
    files = {"image": ("in.png", _png_bytes(), "image/png")}
    assert (
        "lora"
        in assert_openai_error(HTTP.post(url, data={**form, "lora": "{not json"}, files=files))["message"]
    )
    assert_openai_error(HTTP.post(url, data={**form, "lora": '{"path": 5}'}, files=files))
    assert_openai_error(HTTP.post(url, data=form))  # no image
    assert_openai_error(HTTP.post(url, data=form, files={"image": ("x.png", b"not an image", "image/png")}))
    assert_openai_error(HTTP.post(url, json={"prompt": PROMPT}))  # not multipart
    # Z-Image is text-to-image: an edit is refused rather than silently ignoring the image
    lora = json.dumps({"name": "attn", "path": str(paths["attn"])})
    err = assert_openai_error(HTTP.post(url, data={**form, "lora": lora}, files=files))
    assert "image-to-image" in err["message"]
    with pytest.raises(openai.BadRequestError):
        client.images.edit(
            image=("in.png", _png_bytes(), "image/png"), prompt=PROMPT, extra_body={"lora": lora}
        )


MALFORMED = [
    ("/v1/images/generations", {"prompt": PROMPT, "size": "33x33"}),
    ("/v1/images/generations", {"prompt": PROMPT, "size": "0x0"}),
    ("/v1/images/generations", {"prompt": PROMPT, "size": "big"}),
    ("/v1/images/generations", {"prompt": PROMPT, "height": 99999}),
    ("/v1/images/generations", {"prompt": PROMPT, "n": 0}),
    ("/v1/images/generations", {"prompt": PROMPT, "n": 1000}),
    ("/v1/images/generations", {"prompt": PROMPT, "num_inference_steps": 0}),
    ("/v1/images/generations", {"prompt": PROMPT, "guidance_scale": -1}),
    ("/v1/images/generations", {"prompt": PROMPT, "response_format": "url"}),
    ("/v1/images/generations", {"size": "32x32"}),
    ("/v1/images/generations", {"prompt": PROMPT, "seed": "abc"}),
    ("/v1/images/generations", {"prompt": PROMPT, "lora": [{"path": "/x"}] * 3}),  # > max_loras
    ("/v1/images/generations", {"prompt": PROMPT, "lora": {"path": "/etc"}}),
    ("/v1/images/generations", {"prompt": PROMPT, "lora": {"path": "../x", "scale": 1}}),
    ("/v1/images/generations", {"prompt": PROMPT, "lora": {"path": "/x", "scale": ["1"]}}),
    ("/v1/images/generations", {"prompt": PROMPT, "lora": {"path": "/x", "strenght": 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}]}),  # no user text
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "width": 17}),
    ("/v1/completions", {"prompt": PROMPT}),  # no text output on this pipeline
    ("/v1/videos/generations", {"prompt": PROMPT}),  # not a video pipeline
]


@pytest.mark.parametrize("route, body", MALFORMED, ids=[f"{r}-{i}" for i, (r, _) in enumerate(MALFORMED)])
def test_malformed_bodies_get_openai_errors(server, route, body):
    assert_openai_error(HTTP.post(server.url(route), json=body, timeout=600))


def test_pickle_and_duplicate_adapters_are_refused(server, paths):
    url = server.url("/v1/images/generations")
    err = assert_openai_error(
        HTTP.post(url, json={"prompt": PROMPT, "lora": {"path": str(paths["pickled"])}})
    )
    assert "pickle" in err["message"]
    twice = lora_list(paths, ("attn", 1.0), ("attn", 0.5))
    assert_openai_error(HTTP.post(url, json={"prompt": PROMPT, "lora": twice}))
    assert HTTP.get(server.url("/health")).status_code == 200


def test_examples_client_and_curl(server, paths):
    script = REPO_ROOT / "examples" / "online_serving" / "openai_client.py"
    out = subprocess.run(
        [sys.executable, str(script), "--base-url", server.url("/v1"), "--images", "--size", "32x32"]
        + ["--steps", "2", "--lora-name", "attn", "--lora-path", str(paths["attn"]), "--lora-scale", "0.8"]
        + ["--out", str(paths["root"].parent / "example")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert Image.open(paths["root"].parent / "example_0.png").size == (32, 32)
    image = paths["root"].parent / "input.png"
    image.write_bytes(_png_bytes())
    env = dict(
        os.environ,
        BASE_URL=server.base_url,
        MODEL="z-image",
        ADAPTER_PATH=str(paths["attn"]),
        IMAGE=str(image),
    )
    curl = REPO_ROOT / "examples" / "online_serving" / "curl_image_examples.sh"
    out = subprocess.run(["bash", str(curl)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    docs = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert len(docs) == 3
    assert (
        docs[0]["data"][0]["b64_json"]
        and docs[1]["choices"][0]["message"]["content"][0]["type"] == "image_url"
    )
    assert "image-to-image" in docs[2]["error"]["message"]  # edits need an image-to-image pipeline


def test_lycoris_prefix_file_and_single_file_folder(client, server, paths, tiny_z_image_dir):
    """Issue 21 rule 7 through the server and the official client: a LyCORIS file whose keys use the
    flattened ``lycoris_`` prefix serves what its ``lora_unet_`` form does (peft's merged LoKr); a
    folder holding one single-file adapter and no ``adapter_config.json`` serves that file (issue 35);
    one holding two is a 400 that names what a PEFT folder needs and the files to pass instead."""
    import shutil

    from tools.lora_layouts import write_lycoris

    root = paths["root"]
    flat = write_lycoris(str(paths["lokr_peft"]), str(root / "lokr_flat.safetensors"), prefix="lycoris_")
    got = generate(client, lora=[{"name": "lokr_flat", "path": flat, "scale": 1.2}])
    assert close(got, reference(tiny_z_image_dir, [(paths["lokr_peft"], 1.2)], merged=True))
    assert close(got, generate(client, lora=lora_list(paths, ("lokr_file", 1.2))), 0)

    folder = root / "single_file_folder"
    folder.mkdir()
    single = folder / "lokr_v2.safetensors"
    shutil.copy(paths["lokr_file"], single)
    by_folder = generate(client, lora=[{"name": "single_file_folder", "path": str(folder), "scale": 1.2}])
    by_file = generate(client, lora=[{"name": "lokr_v2", "path": str(single), "scale": 1.2}])
    assert close(by_file, got, 0) and close(by_folder, by_file, 0)
    shutil.copy(paths["lokr_file"], folder / "lokr_v3.safetensors")  # two files: which one is meant?
    with pytest.raises(openai.BadRequestError) as info:
        generate(client, lora=[{"name": "two_files", "path": str(folder)}])
    message = info.value.body["message"]
    assert "missing adapter_config.json and adapter_model.safetensors" in message, message
    assert str(single) in message and "pass one by its own path instead" in message, message
    assert "two_files" not in {m.id for m in client.models.list().data}
