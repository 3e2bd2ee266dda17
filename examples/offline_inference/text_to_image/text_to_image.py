"""Text-to-image through ``Omni`` with LoRA adapters, and labelled XY(Z) grids over their scales.

One image::

    python examples/offline_inference/text_to_image/text_to_image.py --prompt "a blue square"

Adapters composed on every request (scales default to 1.0 each)::

    python examples/offline_inference/text_to_image/text_to_image.py --prompt "a red circle" \\
        --lora-paths examples/demo_model/adapters/warm examples/demo_model/adapters/stripes \\
        --lora-scales 0.8 0.6

A grid: each ``--axis`` is ``x|y|z=<dimension>:<v1>,<v2>,...``; the dimensions are
``lora_scale[i]`` (the i-th request adapter: the ``--lora-path`` adapter first if given, then
``--lora-paths`` in order), ``prompt`` (values separated by ``|``), ``guidance_scale``,
``num_inference_steps`` and ``seed``. Cells are the Cartesian product (x columns, y rows, one
panel per z value) and come out as ONE labelled PNG::

    python examples/offline_inference/text_to_image/text_to_image.py --prompt "a red circle" \\
        --lora-paths examples/demo_model/adapters/warm examples/demo_model/adapters/stripes \\
        --axis x=lora_scale[0]:0,0.5,1 y=lora_scale[1]:0,0.5,1 --output grid.png

A scale schedule on an axis: ``lora_schedule[i]`` takes values separated by ``|``, each a number, a
two-phase shorthand ``<a>@<f>><b>`` (scale ``a`` for the step fractions ``[0, f)``, then ``b``) or the
JSON of a schedule (a per-step list, ranges, or ``{"steps": ..., "blocks": {...}}``; see "Scale
schedules" in docs/user_guide/diffusion_lora.md)::

    python examples/offline_inference/text_to_image/text_to_image.py --prompt "a red circle" \
        --lora-paths examples/demo_model/adapters/warm \
        --axis 'x=lora_schedule[0]:1|1@0.5>0|0@0.5>1|{"steps": 1, "blocks": {"layers.0": 0}}' \
        --output schedules.png

Cells that share the denoising settings (steps, guidance, seed) go to ``Omni.generate`` in
one call, each prompt with its own adapter scales, so the stage batches them together. An
adapter whose scale is 0 in a cell is left out of that cell's request. ``--lora-path`` is
pre-loaded (pinned) when the engine starts and applied to every request at ``--lora-scale``
unless an axis sets its scale. The default model is the demo model in ``examples/demo_model``
(64x64 coloured shapes; adapters ``warm`` and ``stripes``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEMO_MODEL = REPO / "examples" / "demo_model"
AXIS_RE = re.compile(r"^(?P<slot>[xyz])=(?P<dim>[a-z_]+(?:\[(?P<index>\d+)\])?):(?P<values>.+)$")
DIMENSIONS = ("lora_scale", "lora_schedule", "prompt", "guidance_scale", "num_inference_steps", "seed")
ADAPTER_DIMS = ("lora_scale", "lora_schedule")
TWO_PHASE_RE = re.compile(r"^(?P<a>[-+0-9.eE]+)@(?P<f>[0-9.eE]+)>(?P<b>[-+0-9.eE]+)$")
GRID_META_KEY = "vllm_omni_grid"


@dataclass
class Axis:
    """One grid axis: ``slot`` (x / y / z), ``dim`` (a name of :data:`DIMENSIONS`), ``index`` (for lora_scale)."""

    slot: str
    dim: str
    index: int | None
    values: list

    @property
    def name(self) -> str:
        return f"{self.dim}[{self.index}]" if self.index is not None else self.dim


@dataclass
class Cell:
    """The settings of one image of the grid."""

    prompt: str
    guidance_scale: float
    num_inference_steps: int
    seed: int
    scales: list  # per adapter a number or a schedule (list / dict, see parse_schedule)
    pos: tuple[int, int, int] = (0, 0, 0)  # (x, y, z) indices


def parse_schedule(text: str) -> float | list | dict:
    """A ``lora_schedule`` axis value: a number, ``<a>@<f>><b>`` (two step-fraction ranges) or JSON.

    The schedule itself is checked by ``OmniDiffusionSamplingParams`` when the cell runs.
    """
    m = TWO_PHASE_RE.match(text)
    if m:
        a, f, b = float(m["a"]), float(m["f"]), float(m["b"])
        return {"steps": [{"start": 0.0, "end": f, "scale": a}, {"start": f, "end": 1.0, "scale": b}]}
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"schedule {text!r} is neither a number, <a>@<f>><b> nor JSON ({exc})") from None


def parse_axis(spec: str, n_adapters: int) -> Axis:
    """Parse ``x=lora_scale[0]:0,0.5,1`` (see the module docstring); ``ValueError`` with the reason."""
    m = AXIS_RE.match(spec.strip())
    if not m:
        raise ValueError(
            f"bad --axis {spec!r}: expected x|y|z=<dimension>:<v1>,<v2>,... e.g. x=lora_scale[0]:0,1"
        )
    dim = m["dim"].split("[")[0]
    index = int(m["index"]) if m["index"] is not None else None
    if dim not in DIMENSIONS:
        raise ValueError(
            f"bad --axis {spec!r}: unknown dimension {dim!r}; choose from {', '.join(DIMENSIONS)}"
        )
    if (dim in ADAPTER_DIMS) != (index is not None):
        need = f"{dim} needs an index ({dim}[0])" if dim in ADAPTER_DIMS else f"{dim} takes no index"
        raise ValueError(f"bad --axis {spec!r}: {need}; only lora_scale / lora_schedule take one")
    if index is not None and index >= n_adapters:
        raise ValueError(
            f"bad --axis {spec!r}: {dim}[{index}] but only {n_adapters} request adapter(s) given"
        )
    raw = m["values"].split("|") if dim in ("prompt", "lora_schedule") else m["values"].split(",")
    raw = [v.strip() for v in raw if v.strip()]
    if not raw:
        raise ValueError(f"bad --axis {spec!r}: no values")
    if dim == "lora_schedule":  # keep the text as the label; the schedule is built per cell
        try:
            [parse_schedule(v) for v in raw]
        except ValueError as exc:
            raise ValueError(f"bad --axis {spec!r}: {exc}") from None
        return Axis(m["slot"], dim, index, raw)
    convert = {"prompt": str, "num_inference_steps": int, "seed": int}.get(dim, float)
    try:
        values = [convert(v) for v in raw]
    except ValueError as exc:
        raise ValueError(f"bad --axis {spec!r}: {exc}") from None
    return Axis(m["slot"], dim, index, values)


def build_cells(args: argparse.Namespace, axes: list[Axis], base_scales: list[float]) -> list[Cell]:
    """Every cell of the grid, z-major then y then x."""
    by_slot = {a.slot: a for a in axes}
    ranges = [range(len(by_slot[s].values)) if s in by_slot else range(1) for s in "zyx"]
    cells = []
    for zi, yi, xi in itertools.product(*ranges):
        cell = Cell(args.prompt, args.guidance_scale, args.num_inference_steps, args.seed, list(base_scales))
        cell.pos = (xi, yi, zi)
        for slot, i in (("x", xi), ("y", yi), ("z", zi)):
            if slot not in by_slot:
                continue
            axis, value = by_slot[slot], by_slot[slot].values[i]
            if axis.dim == "lora_scale":
                cell.scales[axis.index] = value
            elif axis.dim == "lora_schedule":
                cell.scales[axis.index] = parse_schedule(value)
            else:
                setattr(cell, axis.dim, value)
        cells.append(cell)
    return cells


def run_cells(omni, cells: list[Cell], adapters: list, args: argparse.Namespace) -> list:
    """Generate every cell; cells with the same steps / guidance / seed share one ``generate`` call."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(cells):
        groups.setdefault((c.num_inference_steps, c.guidance_scale, c.seed), []).append(i)
    images: list = [None] * len(cells)
    for (steps, guidance, seed), idx in groups.items():
        params = OmniDiffusionSamplingParams(
            height=args.height,
            width=args.width,
            num_inference_steps=steps,
            guidance_scale=guidance,
            seed=seed,
            negative_prompt=args.negative_prompt,
        )
        reqs = [[a for a, s in zip(adapters, cells[i].scales) if s != 0] for i in idx]
        scales = [[s for s in cells[i].scales if s != 0] for i in idx]
        outputs = omni.generate(
            [cells[i].prompt for i in idx],
            params,
            lora_requests=reqs if any(reqs) else None,
            lora_scales=scales if any(reqs) else None,
            use_tqdm=False,
        )
        for i, out in zip(idx, outputs, strict=True):
            images[i] = out.images[0]
    return images


# ---------------------------------------------------------------------------- grid drawing
def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 (bitmap font only)
        return ImageFont.load_default()


def draw_grid(
    cells: list[Cell], images: list, axes: list[Axis], cell_size: int, title: str, axis_names: dict
):
    """One labelled PNG: x columns, y rows, a panel per z value; returns ``(image, metadata)``."""
    from PIL import Image, ImageDraw

    by_slot = {a.slot: a for a in axes}
    nx, ny, nz = (len(by_slot[s].values) if s in by_slot else 1 for s in "xyz")
    w0, h0 = images[0].size
    cw, ch = cell_size, round(cell_size * h0 / w0)
    font_px = max(11, min(18, cell_size // 10))
    font, pad = _font(font_px), 6
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def text_w(s: str) -> int:
        return int(probe.textlength(s, font=font))

    def label(slot: str, i: int) -> str:
        axis = by_slot[slot]
        value = axis.values[i]
        return (
            value
            if axis.dim == "prompt"
            else f"{axis_names[slot]}={value if isinstance(value, str) else f'{value:g}'}"
        )

    row_labels = [label("y", i) for i in range(ny)] if "y" in by_slot else [""]
    left = (max(text_w(s) for s in row_labels) + 2 * pad) if "y" in by_slot else 0
    line = font_px + pad
    top = line * (1 + ("z" in by_slot) + ("x" in by_slot)) + pad
    gap = 2
    panel_w = left + nx * (cw + gap) + pad
    width = max(nz * panel_w + pad, text_w(title) + 3 * pad)
    height = top + ny * (ch + gap) + pad
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.text((pad, pad), title, fill=(0, 0, 0), font=font)
    boxes = []
    for cell, img in zip(cells, images):
        xi, yi, zi = cell.pos
        ox = pad + zi * panel_w + left
        x0, y0 = ox + xi * (cw + gap), top + yi * (ch + gap)
        resample = Image.Resampling.NEAREST if cw % w0 == 0 else Image.Resampling.LANCZOS
        canvas.paste(img.convert("RGB").resize((cw, ch), resample), (x0, y0))
        boxes.append(
            {
                "pos": list(cell.pos),
                "box": [x0, y0, x0 + cw, y0 + ch],
                "scales": cell.scales,
                "prompt": cell.prompt,
                "guidance_scale": cell.guidance_scale,
                "num_inference_steps": cell.num_inference_steps,
                "seed": cell.seed,
            }
        )
        if yi == 0 and "x" in by_slot:
            text = label("x", xi)
            draw.text((x0 + (cw - text_w(text)) // 2, top - line), text, fill=(0, 0, 0), font=font)
        if xi == 0 and "y" in by_slot:
            draw.text((ox - left + pad, y0 + (ch - font_px) // 2), row_labels[yi], fill=(0, 0, 0), font=font)
        if xi == 0 and yi == 0 and "z" in by_slot:
            draw.text((ox, pad + line), label("z", zi), fill=(0, 0, 90), font=font)
    meta = {"cell_size": [cw, ch], "shape": [nx, ny, nz], "image_size": [w0, h0], "cells": boxes}
    return canvas, meta


def save_png(img, path: Path, meta: dict | None = None) -> None:
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    if meta is not None:
        info.add_text(GRID_META_KEY, json.dumps(meta))
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, pnginfo=info)


# ---------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=str(DEMO_MODEL), help="diffusers-format model directory (default: demo model)"
    )
    p.add_argument("--prompt", default="a red circle")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument(
        "--height", type=int, default=None, help="default: the VAE's sample_size (64 for the demo)"
    )
    p.add_argument("--width", type=int, default=None, help="default: the VAE's sample_size")
    p.add_argument("--num-inference-steps", type=int, default=12)
    p.add_argument("--guidance-scale", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lora-path", default=None, help="adapter pre-loaded at start-up and applied to every request"
    )
    p.add_argument("--lora-scale", type=float, default=1.0, help="scale of --lora-path")
    p.add_argument("--lora-paths", nargs="+", default=[], help="adapters composed on every request")
    p.add_argument(
        "--lora-scales", nargs="+", type=float, default=None, help="one per --lora-paths (default 1.0)"
    )
    p.add_argument("--axis", nargs="+", action="extend", default=[], metavar="SLOT=DIM:VALUES")
    p.add_argument("--cell-size", type=int, default=None, help="grid cell width in px (default: >= 192)")
    p.add_argument("--max-batch-size", type=int, default=16, help="prompts per denoiser batch")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--output", default="outputs/text_to_image.png")
    args = p.parse_args(argv)
    if args.lora_scales is not None and len(args.lora_scales) != len(args.lora_paths):
        p.error(f"--lora-scales has {len(args.lora_scales)} values for {len(args.lora_paths)} --lora-paths")
    return args


def _default_size(model: str) -> int:
    try:
        cfg = json.loads((Path(model) / "vae" / "config.json").read_text())
        return int(cfg.get("sample_size") or 1024)
    except (OSError, ValueError):
        return 1024


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    size = _default_size(args.model)
    args.height = args.height or size
    args.width = args.width or size
    paths = ([args.lora_path] if args.lora_path else []) + list(args.lora_paths)
    base_scales = ([args.lora_scale] if args.lora_path else []) + list(
        args.lora_scales or [1.0] * len(args.lora_paths)
    )
    adapters = [
        LoRARequest(Path(p).name or f"adapter{i}", i + 1, str(Path(p).resolve())) for i, p in enumerate(paths)
    ]
    try:
        axes = [parse_axis(spec, len(adapters)) for spec in args.axis]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if len({a.slot for a in axes}) != len(axes):
        raise SystemExit("each of x, y, z may be used by one --axis only")
    cells = build_cells(args, axes, base_scales)

    options = dict(dtype=args.dtype, max_loras=max(1, len(adapters)), enable_progress_bar=False)
    options["max_batch_size"] = args.max_batch_size
    if args.lora_path:
        options.update(lora_path=str(adapters[0].lora_path), lora_scale=args.lora_scale)
    t0 = time.perf_counter()
    with Omni(model=args.model, **options) as omni:
        t1 = time.perf_counter()
        images = run_cells(omni, cells, adapters, args)
    t2 = time.perf_counter()
    out = Path(args.output)
    if not axes:
        save_png(images[0], out)
    else:
        names = {
            a.slot: (f"{a.name} ({adapters[a.index].lora_name})" if a.dim in ADAPTER_DIMS else a.name)
            for a in axes
        }
        short = {a.slot: (adapters[a.index].lora_name if a.dim in ADAPTER_DIMS else a.name) for a in axes}
        dims = {a.dim for a in axes}
        on_axis = {a.index for a in axes if a.dim in ADAPTER_DIMS}
        fixed = [f"{args.prompt!r}"] if "prompt" not in dims else []
        fixed += [
            f"{label} {value:g}"
            for dim, label, value in (
                ("num_inference_steps", "steps", args.num_inference_steps),
                ("guidance_scale", "cfg", args.guidance_scale),
                ("seed", "seed", args.seed),
            )
            if dim not in dims
        ]
        fixed += [
            f"{a.lora_name} {s:g}" for i, (a, s) in enumerate(zip(adapters, base_scales)) if i not in on_axis
        ]
        title = ", ".join(fixed) + "  |  " + "; ".join(f"{s}: {n}" for s, n in names.items())
        cell_size = args.cell_size or args.width * max(1, -(-192 // args.width))
        grid, meta = draw_grid(cells, images, axes, cell_size, title, short)
        meta["adapters"] = [str(a.lora_path) for a in adapters]
        save_png(grid, out, meta)
    print(f"{len(cells)} image(s) in {t2 - t1:.1f} s (engine start {t1 - t0:.1f} s) -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
