"""The in-tree ``WanPipeline`` (``pipeline_backend="auto"`` picks it) against diffusers' ``WanPipeline`` with
peft on the same tiny Wan2.2-style two-expert weights (``tools/make_tiny_wan.py --moe``), float32.

Same prompt, seed, size, frame count, steps and CFG as ``test_wan_moe_distill`` (4 steps: with the
scheduler's shift 3 the timesteps are 1000, 858, 602, 9, so with ``boundary_ratio`` 0.5 steps 0-2 run
``transformer`` and step 3 ``transformer_2``). Adapters: a diffusers/PEFT file at two scales, the ``[high, low]`` pair, a
ComfyUI file (``diffusion_model.blocks.N.self_attn.q...``) and a musubi-tuner / kohya file
(``lora_unet_blocks_N_self_attn_q...``), each read by diffusers' own ``load_lora_weights``; two
requests with different adapters in one batch equal each alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.diffusion.test_wan_moe_distill import GEN, NUM_FRAMES, PROMPT, SEED, _write_adapter
from tests.diffusion.test_wan_moe_targets import _diffusers
from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.request import LoRARequest

pytestmark = [pytest.mark.slow]
TOL = 1e-4
#: native Wan module names -> (in, out) on the tiny model (dim 16, ffn 32)
NATIVE_MODULES = {
    **{f"self_attn.{p}": (16, 16) for p in "qkvo"},
    **{f"cross_attn.{p}": (16, 16) for p in "qkvo"},
    "ffn.0": (16, 32),
    "ffn.2": (32, 16),
}


def _native_tensors(seed: int, rank: int = 4, alpha: float = 2.0) -> dict[str, tuple]:
    """Random ``(down (r, in), up (out, r), alpha)`` per native module of both blocks."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for block in range(2):
        for name, (d_in, d_out) in NATIVE_MODULES.items():
            down = torch.randn(rank, d_in, generator=g) * 0.4
            up = torch.randn(d_out, rank, generator=g) * 0.4
            out[f"blocks.{block}.{name}"] = (down, up, torch.tensor(alpha))
    return out


def _write_native(root: Path, seed: int) -> dict[str, str]:
    """The same adapter as a ComfyUI file and a musubi-tuner (kohya) file."""
    from safetensors.torch import save_file

    tensors = _native_tensors(seed)
    comfy, musubi = {}, {}
    for name, (down, up, alpha) in tensors.items():
        comfy |= {
            f"diffusion_model.{name}.lora_A.weight": down,
            f"diffusion_model.{name}.lora_B.weight": up,
            f"diffusion_model.{name}.alpha": alpha,
        }
        flat = "lora_unet_" + name.replace(".", "_")
        musubi |= {f"{flat}.lora_down.weight": down, f"{flat}.lora_up.weight": up, f"{flat}.alpha": alpha}
    paths = {"comfy": str(root / "wan_comfy.safetensors"), "musubi": str(root / "wan_musubi.safetensors")}
    save_file(comfy, paths["comfy"])
    save_file(musubi, paths["musubi"])
    return paths


@pytest.fixture(scope="module")
def wan_moe_dir() -> Path:
    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan

    return ensure_tiny_wan(test_assets_root(), moe=True)


@pytest.fixture(scope="module")
def files(wan_moe_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("wan_in_tree_loras")
    high = _write_adapter(wan_moe_dir, "transformer", 10, root / "high")
    low = _write_adapter(wan_moe_dir, "transformer_2", 11, root / "low")
    return {"high": os.fspath(high), "low": os.fspath(low), **_write_native(root, 20)}


@pytest.fixture(scope="module")
def loras(files) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(files.items()))}


@pytest.fixture(scope="module")
def omni(wan_moe_dir):
    from vllm_omni import Omni

    with Omni(str(wan_moe_dir), max_loras=2, dtype="float32", enable_progress_bar=False) as engine:
        assert engine._orchestrator.runtimes[0].describe().output_kind == "video"
        yield engine


def _sp(output_type: str = "latent", **extra):
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return OmniDiffusionSamplingParams(
        seed=SEED, output_type=output_type, extra_args={"num_frames": NUM_FRAMES, **extra}, **GEN
    )


def _latents(omni, **adapters) -> torch.Tensor:
    [out] = omni.generate([PROMPT], _sp(), use_tqdm=False, **adapters)
    return torch.as_tensor(out.latents).float()


def _diffusers_frames(model_dir: Path) -> np.ndarray:
    """diffusers' decoded frames ``(1, F, H, W, 3)`` float in [0, 1] (``output_type="np"``)."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    gen = [torch.Generator().manual_seed(SEED)]
    return pipe(prompt=[PROMPT], num_frames=NUM_FRAMES, output_type="np", generator=gen, **GEN).frames


def _err(a, b) -> float:
    return float((torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs().max())


def test_runs_in_tree_and_equals_diffusers_without_adapters(omni, wan_moe_dir):
    from vllm_omni.diffusion.models.wan.pipeline import WanPipeline

    pipeline = omni._orchestrator.runtimes[0]._engine.pipeline
    assert isinstance(pipeline, WanPipeline) and pipeline.transformer_2 is not None
    [out] = omni.generate([PROMPT], _sp("np"), use_tqdm=False)
    want = _diffusers_frames(wan_moe_dir)
    frames = out.stage_outputs[0].array
    assert frames.shape == want.shape == (1, NUM_FRAMES, 32, 48, 3)
    assert _err(frames, want) <= TOL
    assert _err(out.latents, _diffusers(wan_moe_dir, [], [])) <= TOL
    assert WanPipeline.mixed_lora_batch and WanPipeline.reports_denoising_step


def test_diffusers_peft_file_at_two_scales_and_the_pair(omni, wan_moe_dir, files, loras):
    base = _diffusers(wan_moe_dir, [], [])
    for scale in (0.5, 1.0):
        want = _diffusers(wan_moe_dir, [files["high"]], [], weights=[scale])
        assert _err(want, base) > 0.02  # the adapter matters at this scale
        assert _err(_latents(omni, lora_requests=[loras["high"]], lora_scales=[scale]), want) <= TOL
    pair = _diffusers(wan_moe_dir, [files["high"]], [files["low"]])
    assert _err(_latents(omni, lora_requests=[loras["high"], loras["low"]]), pair) <= TOL


@pytest.mark.parametrize("layout", ["comfy", "musubi"])
def test_comfyui_and_musubi_files_read_as_diffusers_reads_them(omni, wan_moe_dir, files, loras, layout):
    want = _diffusers(wan_moe_dir, [files[layout]], [])
    assert _err(want, _diffusers(wan_moe_dir, [], [])) > 0.02
    assert _err(_latents(omni, lora_requests=[loras[layout]]), want) <= TOL


def test_mixed_batch_equals_each_request_alone(omni, loras):
    """Two prompts with different adapter sets (and one without) in one call: one denoiser batch
    (the pipeline reports its CFG row layout), each equal to its request run alone."""
    prompts = [PROMPT, "a blue dog on a ball", PROMPT]
    sets = [[loras["high"]], [loras["comfy"]], []]
    stage = omni._orchestrator.runtimes[0]
    before = len(stage.batch_sizes)
    outs = omni.generate(prompts, _sp(), lora_requests=sets, use_tqdm=False)
    assert stage.batch_sizes[before:] == [3], "the three requests must share one denoiser batch"
    for prompt, adapters, out in zip(prompts, sets, outs, strict=True):
        [alone] = omni.generate([prompt], _sp(), lora_requests=adapters, use_tqdm=False)
        assert _err(out.latents, alone.latents) <= TOL
    assert _err(outs[0].latents, outs[2].latents) > 0.02


def test_per_step_schedules_across_the_expert_switch(omni, wan_moe_dir, files, loras):
    """Per-step scales of the pair (high on ``transformer``, low on ``transformer_2``) equal diffusers
    changing ``set_adapters`` weights in ``callback_on_step_end``; the switch to the low-noise expert
    after step 2 is a step boundary, so each step's scale acts on the expert that runs it."""
    high, low = [1.0, 0.5, 1.5, 0.0], [0.0, 0.0, 0.0, 0.5]

    def callback(pipe, i, _t, _kwargs):
        if i + 1 < len(high):
            pipe.set_adapters(["t1_0", "t2_0"], [high[i + 1], low[i + 1]])
        return {}

    want = _diffusers(
        wan_moe_dir, [files["high"]], [files["low"]], weights=[high[0], low[0]], callback_on_step_end=callback
    )
    constant = _diffusers(wan_moe_dir, [files["high"]], [files["low"]], weights=[1.0, 0.5])
    assert _err(want, constant) > 0.02  # the schedule matters
    got = _latents(omni, lora_requests=[loras["high"], loras["low"]], lora_scales=[high, low])
    assert _err(got, want) <= TOL


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"num_frames": 6}, r"num_frames must be 1 \+ a multiple of 4.*got 6"),
        ({"flow_shift": 2.0}, r"extra_args \['flow_shift'\] are not used by the in-tree WanPipeline"),
        ({"attention_kwargs": {"scale": 0.5, "other": 1}}, r"attention_kwargs'\] keys \['other'\]"),
    ],
)
def test_bad_requests_are_refused_naming_the_culprit(omni, extra, match):
    with pytest.raises(InvalidRequestError, match=match):
        omni.generate([PROMPT], _sp(**extra), use_tqdm=False)
    assert np.isfinite(_latents(omni).numpy()).all()  # the stage keeps serving


def test_single_expert_distill_file_equals_diffusers(tmp_path):
    """Wan2.1-style single expert (``tiny-wan``): one file fused at start-up (``lora_backend="distill"``)
    equals diffusers' ``load_lora_weights`` of the same file; the stage runs the in-tree pipeline."""
    from diffusers import WanPipeline as Reference

    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan
    from vllm_omni import Omni
    from vllm_omni.diffusion.models.wan.pipeline import WanPipeline

    model_dir = ensure_tiny_wan(test_assets_root())
    path = os.fspath(_write_adapter(model_dir, "transformer", 30, tmp_path / "distill"))
    ref = Reference.from_pretrained(str(model_dir))
    ref.set_progress_bar_config(disable=True)
    ref.load_lora_weights(path)
    gen = [torch.Generator().manual_seed(SEED)]
    want = ref(prompt=[PROMPT], num_frames=NUM_FRAMES, output_type="latent", generator=gen, **GEN).frames
    ref.unload_lora_weights()
    gen = [torch.Generator().manual_seed(SEED)]
    base = ref(prompt=[PROMPT], num_frames=NUM_FRAMES, output_type="latent", generator=gen, **GEN).frames
    assert _err(want, base) > 0.02  # the file matters
    with Omni(str(model_dir), lora_path=[path], lora_backend="distill", dtype="float32") as omni:
        pipeline = omni._orchestrator.runtimes[0]._engine.pipeline
        assert isinstance(pipeline, WanPipeline) and pipeline.transformer_2 is None
        got = _latents(omni)
    assert _err(got, want) <= TOL


def test_adapters_that_do_not_fit_are_refused_naming_the_culprit(omni, tmp_path):
    """A file for another model size names the module and both shapes; nothing is registered (lightx2v
    files with ``diff_b`` / ``diff`` deltas: ``test_wan_lightx2v_deltas``)."""
    from safetensors.torch import save_file

    from vllm_omni.errors import LoRAFormatError

    g = torch.Generator().manual_seed(0)
    wrong = {
        "diffusion_model.blocks.0.self_attn.q.lora_A.weight": torch.randn(4, 24, generator=g),
        "diffusion_model.blocks.0.self_attn.q.lora_B.weight": torch.randn(16, 4, generator=g),
    }
    before = omni.list_loras()
    path = tmp_path / "wrong.safetensors"
    save_file(wrong, str(path))
    with pytest.raises(
        LoRAFormatError, match=r"wrong\.safetensors: module '.*blocks\.0\.attn1\.to_q' has lora_A \(4, 24\)"
    ):
        omni.add_lora(LoRARequest("wrong", 50, str(path)))
    assert omni.list_loras() == before


def test_the_diffusers_fallback_still_runs_wan(wan_moe_dir, files, loras):
    """``pipeline_backend="diffusers"`` keeps diffusers' own ``WanPipeline`` (the fallback that served Wan
    before the in-tree port): the pair with ``attention_kwargs={"scale": 0.5}`` equals diffusers there too,
    and its ``pil`` output is one list of frames per video."""
    from vllm_omni import Omni
    from vllm_omni.diffusion.pipelines.diffusers_fallback import DiffusersFallbackPipeline

    pair = [loras["high"], loras["low"]]
    want = _diffusers(
        wan_moe_dir, [files["high"]], [files["low"]], weights=[1.0, 1.0], attention_kwargs={"scale": 0.5}
    )
    with Omni(str(wan_moe_dir), max_loras=2, dtype="float32", pipeline_backend="diffusers") as omni:
        assert isinstance(omni._orchestrator.runtimes[0]._engine.pipeline, DiffusersFallbackPipeline)
        [out] = omni.generate(
            [PROMPT], _sp(attention_kwargs={"scale": 0.5}), lora_requests=pair, use_tqdm=False
        )
        [video] = omni.generate([PROMPT], _sp("pil"), use_tqdm=False)
    assert _err(out.latents, want) <= TOL
    assert len(video.videos) == 1 and len(video.videos[0]) == NUM_FRAMES
