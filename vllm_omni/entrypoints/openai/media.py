"""Image/video encoding for responses, and input images: multipart forms (``/v1/images/edits``,
``/v1/videos/generations``) and base64 fields of JSON bodies."""

from __future__ import annotations

import base64
import io
import json
import os
import tempfile
from typing import Any

import numpy as np
from fastapi import Request
from PIL import Image, UnidentifiedImageError

from vllm_omni.entrypoints.openai.errors import bad_request
from vllm_omni.errors import OpenAIError

MAX_UPLOAD_BYTES = 32 * 1024 * 1024
_FORM_NUMBERS = ("n", "height", "width", "num_inference_steps", "seed", "guidance_scale")


def _to_pil(image: Any):
    if isinstance(image, Image.Image):
        return image

    arr = image.detach().cpu().numpy() if hasattr(image, "detach") else np.asarray(image)
    if arr.dtype != np.uint8:
        arr = (np.clip(arr, 0.0, 1.0) * 255).round().astype(np.uint8)
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)
    return Image.fromarray(arr.squeeze(-1) if arr.ndim == 3 and arr.shape[-1] == 1 else arr)


def png_b64(image: Any) -> str:
    """Base64 PNG of a PIL image (or an HWC/CHW array in [0, 1] / uint8)."""
    buf = io.BytesIO()
    _to_pil(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


#: ``output_format`` of an image request -> Pillow's format name
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def image_b64(image: Any, output_format: str = "png", compression: int | None = None) -> str:
    """Base64 of an image encoded as ``output_format`` (``png``, ``jpeg``, ``webp``; Pillow).

    ``compression``: OpenAI's ``output_compression`` (0-100) for JPEG / WebP: 100 keeps the most
    (quality 100), 0 the least; ``None``: Pillow's default quality (75). Ignored for PNG (lossless).
    JPEG has no alpha: an RGBA image is flattened to RGB.
    """
    pil = _to_pil(image)
    fmt = IMAGE_FORMATS[output_format]
    kwargs: dict[str, Any] = {}
    if fmt != "PNG" and compression is not None:
        kwargs["quality"] = max(1, compression)
    if fmt == "JPEG" and pil.mode not in ("RGB", "L"):
        pil = pil.convert("RGB")
    buf = io.BytesIO()
    pil.save(buf, format=fmt, **kwargs)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def png_data_uri(image: Any) -> str:
    return "data:image/png;base64," + png_b64(image)


def video_frames(outputs: list[Any]) -> list[Any]:
    """Frames of the first video among the final outputs (``.videos`` or ``.images`` frames)."""
    for out in outputs:
        videos = getattr(out, "videos", None)
        if videos:
            video = videos[0]
            return list(video) if not isinstance(video, list) else video
    for out in outputs:
        images = getattr(out, "images", None)
        if images:
            first = images[0]
            if isinstance(first, list):  # one list of frames per video
                return first
            return list(images)
    raise OpenAIError("the pipeline returned no video", 500)


def encode_video(frames: list[Any], fps: int, fmt: str | None = None) -> tuple[str, str]:
    """``(base64, format)`` of ``frames`` as ``fmt`` (``"mp4"`` or ``"gif"``).

    ``fmt=None``: MP4 when OpenCV can write it, else an animated GIF.

    Raises:
        OpenAIError: (400) ``"mp4"`` asked for but OpenCV cannot write it here.
    """
    pil = [_to_pil(f).convert("RGB") for f in frames]
    if fmt == "gif":
        return _gif_b64(pil, fps), "gif"
    try:
        import cv2  # optional: OpenCV is no dependency of vllm_omni (without it: GIF)

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "video.mp4")
            w, h = pil[0].size
            writer = cv2.VideoWriter(path, cv2.VideoWriter.fourcc(*"mp4v"), fps, (w, h))
            if writer.isOpened():
                for frame in pil:
                    writer.write(cv2.cvtColor(np.asarray(frame), cv2.COLOR_RGB2BGR))
                writer.release()
                with open(path, "rb") as f:
                    data = f.read()
                if data:
                    return base64.b64encode(data).decode("ascii"), "mp4"
    except ImportError:
        pass
    if fmt == "mp4":
        raise bad_request("video_format 'mp4' is not available on this server (no OpenCV MP4 writer)")
    return _gif_b64(pil, fps), "gif"


def _gif_b64(pil: list[Any], fps: int) -> str:
    buf = io.BytesIO()
    pil[0].save(buf, format="GIF", save_all=True, append_images=pil[1:], duration=int(1000 / fps), loop=0)
    return base64.b64encode(buf.getvalue()).decode("ascii")


async def read_edit_form(request: Request) -> tuple[dict[str, Any], Any]:
    """Fields and the input image of a multipart ``/v1/images/edits`` body (see :func:`read_image_form`).

    Raises:
        OpenAIError: (400) not multipart, no/unsupported image, bad ``lora`` JSON.
    """
    fields, image = await read_image_form(request, ("image", "image[]"), "images/edits")
    if image is None:
        raise bad_request("images/edits needs an 'image' file", "image")
    return fields, image


async def read_image_form(
    request: Request, names: tuple[str, ...], route: str
) -> tuple[dict[str, Any], Image.Image | None]:
    """Text fields and the first image file under one of ``names`` of a multipart body (``None``
    when the form has none), the image decoded to RGB.

    ``lora`` is JSON text; numeric fields arrive as text and are validated by the body model.

    Raises:
        OpenAIError: (400) not multipart, an unreadable or too large image, a non-file field, bad
            ``lora`` JSON; each naming the field.
    """
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise bad_request(f"{route} takes multipart/form-data (fields plus an {names[0]!r} file)")
    try:
        form = await request.form()
    except Exception as exc:
        raise bad_request(f"cannot read the multipart body: {exc}") from exc
    fields: dict[str, Any] = {}
    upload = None
    for key, value in form.multi_items():
        if key in names:
            if upload is None:
                upload = value
            continue
        if not isinstance(value, str):
            raise bad_request(f"form field {key!r} must be text", key)
        fields[key] = value
    if isinstance(upload, str):
        raise bad_request(f"form field {names[0]!r} must be a file", names[0])
    image = None if upload is None else decode_image(await upload.read(), names[0])
    if "lora" in fields:
        try:
            fields["lora"] = json.loads(fields["lora"])
        except json.JSONDecodeError as exc:
            raise bad_request(f"form field 'lora' must be JSON text: {exc.msg}", "lora") from exc
        except RecursionError as exc:
            raise bad_request("form field 'lora' is nested too deeply", "lora") from exc
    return fields, image


def decode_image(data: bytes, field: str) -> Image.Image:
    """An uploaded PNG / JPEG / WebP file as an RGB PIL image.

    Raises:
        OpenAIError: (400, naming ``field``) larger than ``MAX_UPLOAD_BYTES`` or not a readable image.
    """
    if len(data) > MAX_UPLOAD_BYTES:
        raise bad_request(f"{field} is larger than {MAX_UPLOAD_BYTES} bytes", field)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise bad_request(f"{field} is not a readable PNG/JPEG/WebP image", field) from exc


def image_from_base64(text: str, field: str) -> Image.Image:
    """A base64 image in a JSON body (plain base64, or a ``data:image/...;base64,`` URI) as RGB.

    Raises:
        OpenAIError: (400, naming ``field``) not base64, another data URI kind, or see :func:`decode_image`.
    """
    if text.startswith("data:"):
        head, _, text = text.partition(",")
        if not head.startswith("data:image/") or not head.endswith(";base64"):
            raise bad_request(f"{field} must be a base64 image (data:image/...;base64,...)", field)
    try:
        data = base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"{field} is not valid base64", field) from exc
    return decode_image(data, field)
