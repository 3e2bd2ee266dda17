"""The offline examples run end to end on the shipped demo model / tiny LLM (quick settings).

* ``text_to_image.py``: a 2x2 grid over the two demo adapters' scales is one labelled PNG with
  the expected geometry; its (0, 0) cell is the base image, and every scale change changes the
  image the way the adapter is meant to (warm: redder, less blue; stripes: more texture).
* ``llm_lora.py``: each adapter changes the greedy text of the tiny LLM.
* ``qwen2_5_omni.py``: text and a WAV from the tiny Qwen2.5-Omni (thinker -> talker -> code2wav).
* ``rl_rollouts.py``: peft optimizer steps (the tiny LLM, the demo DiT), each adapter handed over in memory;
  every rollout equals transformers+peft / diffusers+peft on that step's weights.
* the demo model itself: a few MB, loads in diffusers' ``ZImagePipeline`` in fp32.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests import preload

REPO = Path(__file__).resolve().parents[2]
T2I = REPO / "examples" / "offline_inference" / "text_to_image" / "text_to_image.py"
LLM = REPO / "examples" / "offline_inference" / "llm_lora.py"
OMNI = REPO / "examples" / "offline_inference" / "qwen2_5_omni.py"
RL = REPO / "examples" / "offline_inference" / "rl_rollouts.py"
DEMO = REPO / "examples" / "demo_model"
ADAPTERS = [str(DEMO / "adapters" / "warm"), str(DEMO / "adapters" / "stripes")]
QUICK = ["--prompt", "a blue square", "--num-inference-steps", "4", "--guidance-scale", "3", "--seed", "1"]


def _run(script: Path, *args: str, timeout: int = 1800) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # as in a fresh shell: the KV cache budget is automatic
    proc = preload.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _t2i_module():
    spec = importlib.util.spec_from_file_location("text_to_image_example", T2I)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0


def _texture(a: np.ndarray) -> float:
    """Mean absolute difference between diagonal neighbours (stripes raise it)."""
    return float(np.abs(a[1:, 1:] - a[:-1, :-1]).mean())


def test_demo_model_is_small_and_loads_in_diffusers_fp32():
    import torch
    from diffusers import ZImagePipeline

    total = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    assert total < 10 * 2**20, f"demo model is {total / 2**20:.1f} MiB"
    pipe = ZImagePipeline.from_pretrained(str(DEMO))
    assert {p.dtype for p in pipe.transformer.parameters()} == {torch.float32}
    for name in ("warm", "stripes"):
        cfg = json.loads((DEMO / "adapters" / name / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] > 0


@pytest.mark.slow
def test_text_to_image_lora_grid(tmp_path):
    base_png, grid_png = tmp_path / "base.png", tmp_path / "grid.png"
    _run(T2I, *QUICK, "--output", str(base_png))
    out = _run(
        T2I,
        *QUICK,
        "--lora-paths",
        *ADAPTERS,
        "--axis",
        "x=lora_scale[0]:0,1",
        "y=lora_scale[1]:0,1",
        "--cell-size",
        "64",
        "--output",
        str(grid_png),
    )
    assert "4 image(s)" in out
    base = Image.open(base_png)
    assert base.size == (64, 64)  # the demo model's native size

    grid = Image.open(grid_png)
    meta = json.loads(grid.text["vllm_omni_grid"])
    assert meta["shape"] == [2, 2, 1] and meta["cell_size"] == [64, 64] and len(meta["cells"]) == 4
    cells = {}
    for c in meta["cells"]:
        x0, y0, x1, y1 = c["box"]
        assert (x1 - x0, y1 - y0) == (64, 64) and x1 <= grid.width and y1 <= grid.height
        cells[tuple(c["pos"][:2])] = (c["scales"], _pixels(grid.crop((x0, y0, x1, y1))))
    # two columns and two rows of cells plus room for the labels
    assert grid.width > 2 * 64 + 20 and grid.height > 2 * 64 + 20
    assert cells[(1, 0)][0] == [1.0, 0.0] and cells[(0, 1)][0] == [0.0, 1.0]

    plain, warm, striped, both = (cells[k][1] for k in [(0, 0), (1, 0), (0, 1), (1, 1)])
    # the (0, 0) cell is the base image (batched with adapter requests: allow 1/255 of noise)
    assert np.abs(plain - _pixels(base)).max() <= 1.5 / 255
    for a, b in [(plain, warm), (plain, striped), (warm, both), (striped, both)]:
        assert np.abs(a - b).mean() > 0.02

    # warm: red up relative to blue; stripes: more diagonal texture
    def red_minus_blue(a):
        return float((a[..., 0] - a[..., 2]).mean())

    assert red_minus_blue(warm) > red_minus_blue(plain) + 0.1
    assert _texture(striped) > _texture(plain) + 0.02
    assert red_minus_blue(both) > red_minus_blue(striped) + 0.05 and _texture(both) > _texture(warm) + 0.01


def test_axis_parsing():
    t2i = _t2i_module()
    a = t2i.parse_axis("x=lora_scale[1]:0,0.5,1", 2)
    assert (a.slot, a.dim, a.index, a.values) == ("x", "lora_scale", 1, [0.0, 0.5, 1.0])
    p = t2i.parse_axis("y=prompt:a red circle|a blue square", 0)
    assert p.values == ["a red circle", "a blue square"]
    assert t2i.parse_axis("z=num_inference_steps:2,4", 0).values == [2, 4]
    assert t2i.parse_axis("z=seed:1,2", 0).values == [1, 2]
    assert t2i.parse_axis("x=guidance_scale:0,2.5", 0).values == [0.0, 2.5]
    s = t2i.parse_axis('y=lora_schedule[0]:1|1@0.4>0.3|[1, 0.5]|{"steps": 1, "blocks": {"layers.0": 0}}', 1)
    assert s.values == ["1", "1@0.4>0.3", "[1, 0.5]", '{"steps": 1, "blocks": {"layers.0": 0}}']
    assert [t2i.parse_schedule(v) for v in s.values] == [
        1.0,
        {"steps": [{"start": 0.0, "end": 0.4, "scale": 1.0}, {"start": 0.4, "end": 1.0, "scale": 0.3}]},
        [1, 0.5],
        {"steps": 1, "blocks": {"layers.0": 0}},
    ]
    for bad, why in [
        ("x=lora_scale[2]:0,1", "only 2"),
        ("w=seed:1", "expected"),
        ("x=cfg:1,2", "unknown dimension"),
        ("x=lora_scale:1", "needs an index"),
        ("x=seed:a,b", "invalid literal"),
        ("x=lora_schedule:1", "lora_schedule needs an index"),
        ("x=lora_schedule[0]:1|[1,", "neither a number"),
    ]:
        with pytest.raises(ValueError, match=why):
            t2i.parse_axis(bad, 2)


def test_grid_cells_and_batching_groups():
    t2i = _t2i_module()
    args = t2i.parse_args(["--lora-paths", "a", "b", "--lora-scales", "0.5", "0.7"])
    axes = [t2i.parse_axis("x=lora_scale[0]:0,1", 2), t2i.parse_axis("z=seed:3,4", 2)]
    cells = t2i.build_cells(args, axes, [0.5, 0.7])
    assert [(c.pos, c.scales, c.seed) for c in cells] == [
        ((0, 0, 0), [0.0, 0.7], 3),
        ((1, 0, 0), [1.0, 0.7], 3),
        ((0, 0, 1), [0.0, 0.7], 4),
        ((1, 0, 1), [1.0, 0.7], 4),
    ]


@pytest.mark.slow
def test_text_to_image_schedule_axis(tmp_path):
    grid_png = tmp_path / "grid.png"
    out = _run(
        T2I,
        *QUICK,
        "--lora-paths",
        ADAPTERS[0],
        "--axis",
        'x=lora_schedule[0]:1|1@0.5>0|0|{"steps": 1, "blocks": {"noise_refiner": 0, "layers.*": 0}}',
        "--cell-size",
        "64",
        "--output",
        str(grid_png),
    )
    assert "4 image(s)" in out
    grid = Image.open(grid_png)
    meta = json.loads(grid.text["vllm_omni_grid"])
    assert meta["shape"] == [4, 1, 1]
    cells = {}
    for c in meta["cells"]:
        cells[c["pos"][0]] = (c["scales"], _pixels(grid.crop(tuple(c["box"]))))
    assert cells[1][0] == [
        {"steps": [{"start": 0.0, "end": 0.5, "scale": 1.0}, {"start": 0.5, "end": 1.0, "scale": 0.0}]}
    ]
    full, half, off, blocks_off = (cells[i][1] for i in range(4))
    # warm for the first half of the steps lies between the adapter at 1 throughout and not at all
    d_full, d_half = np.abs(full - off).mean(), np.abs(half - off).mean()
    assert 0.005 < d_half < d_full
    assert np.abs(blocks_off - full).mean() > 0.005  # switching blocks off changes the image


@pytest.mark.slow
@pytest.mark.engine
def test_llm_lora_example(tiny_llm_assets):
    out = _run(LLM, "--prompt", "the quick brown fox", "--max-tokens", "8")
    lines = [line for line in out.splitlines() if " -> " in line]
    assert len(lines) == 3
    assert [label in line for line, label in zip(lines, ["adapter_a", "adapter_b", "(no adapter)"])] == [
        True
    ] * 3
    assert len({line.split(" -> ", 1)[1] for line in lines}) == 3  # each adapter changes the continuation


def test_qwen2_5_omni_example(tiny_omni_assets, tmp_path):
    import wave

    out = _run(OMNI, "--max-tokens", "6", "--talker-max-tokens", "16", "--out", str(tmp_path / "reply.wav"))
    assert "text: " in out and "audio: " in out
    # issue 49: vLLM's per-weight dtype warnings are one line per stage process, its Triton notes gone
    assert "Attempted to load weight" not in out and out.count("Loading the checkpoint's float32") <= 3, out
    assert "Triton" not in out, out
    with wave.open(str(tmp_path / "reply.wav")) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000) and w.getnframes() > 0


def test_rl_rollouts_example(tiny_llm_assets):
    out = _run(RL, "--steps", "2", "--max-tokens", "4", "--diffusion-steps", "2")
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all(line.endswith("equals transformers+peft: True") for line in lines)
    assert "version 2" in lines[1]
    dit = [line for line in out.splitlines() if line.startswith("diffusion step ")]
    assert len(dit) == 2, out
    assert all("adapter acts: True, rollout equals diffusers+peft: True" in line for line in dit), dit
