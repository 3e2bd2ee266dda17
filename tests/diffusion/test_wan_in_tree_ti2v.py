"""Wan2.2 TI2V-5B (``expand_timesteps``) on the in-tree pipeline, which ``pipeline_backend="auto"`` picks, on a
folder written as the published one (``tools/make_tiny_wan.py --ti2v``: ``_class_name`` ``WanPipeline``, 48
latent channels, a Wan2.2-style 16x VAE): one stage makes image-to-video from a request with an image, against
diffusers' ``WanImageToVideoPipeline.from_pretrained`` of the same folder with peft, and text-to-video from a
request without one, against diffusers' ``WanPipeline`` of the same folder; float32, same prompt, seed and
image: final latents (and decoded frames) within 1e-4 without an adapter and with a PEFT file at scale 0.6
(diffusers: ``load_lora_weights`` + ``set_adapters``). The image conditioning: the image is the clean first
latent frame of every step's input and of the result, whose tokens get timestep 0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.diffusion.test_wan_in_tree_i2v import _err, _image, i2v_reference_class
from tests.diffusion.test_wan_moe_distill import PROMPT, SEED, _write_adapter
from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.request import LoRARequest

pytestmark = [pytest.mark.slow]
TOL = 1e-4
#: sizes are multiples of 32 (the 16x VAE times the 2x2 patch): 3 latent frames of 2 x 2 tokens
GEN = {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 3.0}
NUM_FRAMES = 9
SCALE = 0.6


@pytest.fixture(scope="module")
def ti2v_dir() -> Path:
    from tests.conftest import test_assets_root
    from tools.make_tiny_wan import ensure_tiny_wan

    return ensure_tiny_wan(test_assets_root(), ti2v=True)


@pytest.fixture(scope="module")
def adapter(ti2v_dir, tmp_path_factory) -> str:
    return os.fspath(_write_adapter(ti2v_dir, "transformer", 12, tmp_path_factory.mktemp("ti2v") / "a"))


@pytest.fixture(scope="module")
def reference(ti2v_dir, adapter) -> dict[str, torch.Tensor]:
    """diffusers' image-to-video latents and ``np`` frames without the adapter, latents with it at ``SCALE``,
    and ``WanPipeline``'s text-to-video latents (``"t2v"``), all from the same folder."""
    import diffusers

    index = json.loads((ti2v_dir / "model_index.json").read_text())
    assert (index["_class_name"], index["expand_timesteps"], index["boundary_ratio"]) == (
        "WanPipeline",
        True,
        None,
    )
    gen = {"num_frames": NUM_FRAMES, "output_type": "latent", **GEN}
    t2v = diffusers.WanPipeline.from_pretrained(str(ti2v_dir))
    t2v.set_progress_bar_config(disable=True)
    out = {"t2v": t2v(prompt=[PROMPT], generator=[torch.Generator().manual_seed(SEED)], **gen).frames}
    pipe = i2v_reference_class().from_pretrained(str(ti2v_dir))
    assert pipe.config.expand_timesteps
    pipe.set_progress_bar_config(disable=True)

    def run(output_type: str) -> torch.Tensor:
        gen = [torch.Generator().manual_seed(SEED)]
        call = {"num_frames": NUM_FRAMES, "output_type": output_type, "generator": gen, **GEN}
        return torch.as_tensor(pipe(image=_image(0), prompt=[PROMPT], **call).frames).float()

    out |= {"latents": run("latent"), "frames": run("np")}
    pipe.load_lora_weights(adapter, adapter_name="a")
    pipe.set_adapters(["a"], [SCALE])
    out["lora"] = run("latent")
    return out


def _sp(output_type: str = "latent", **extra):
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return OmniDiffusionSamplingParams(
        seed=SEED, output_type=output_type, extra_args={"num_frames": NUM_FRAMES, **extra}, **GEN
    )


def test_ti2v_folder_makes_video_from_an_image_and_from_text_as_diffusers(ti2v_dir, adapter, reference):
    from vllm_omni import Omni
    from vllm_omni.diffusion.models.wan.pipeline import WanPipeline

    with Omni(str(ti2v_dir), dtype="float32", enable_progress_bar=False) as omni:
        runtime = omni._orchestrator.runtimes[0]
        pipeline = runtime._engine.pipeline
        assert type(pipeline) is WanPipeline and pipeline.expand_timesteps
        described = runtime.describe()
        assert described.inputs == {"text", "image"} and described.image_optional
        [base] = omni.generate([PROMPT], _sp("np", image=_image(0)), use_tqdm=False)
        lora = LoRARequest("a", 1, adapter)
        [adapted] = omni.generate(
            [PROMPT], _sp(image=_image(0)), lora_requests=[lora], lora_scales=[SCALE], use_tqdm=False
        )
        [text] = omni.generate([PROMPT], _sp(), use_tqdm=False)
        with pytest.raises(InvalidRequestError, match=r"extra_args\['last_image'\] is not used"):
            omni.generate([PROMPT], _sp(image=_image(0), last_image=_image(1)), use_tqdm=False)
    assert _err(text.latents, reference["t2v"]) <= TOL
    assert _err(reference["t2v"], reference["latents"]) > 0.1  # the image matters
    frames = base.stage_outputs[0].array
    assert frames.shape == reference["frames"].shape == (1, NUM_FRAMES, 64, 64, 3)
    assert _err(frames, reference["frames"]) <= TOL
    assert _err(base.latents, reference["latents"]) <= TOL
    assert _err(reference["lora"], reference["latents"]) > 0.02  # the adapter matters at this scale
    assert _err(adapted.latents, reference["lora"]) <= TOL


def test_warmed_compiled_ti2v_stage_compiles_nothing_for_image_or_text_requests(ti2v_dir, adapter, tmp_path):
    """Compiled blocks (dynamo's ``eager`` backend, the ``compile_backend`` option): after the warm-up (which
    sends a grey image to a stage that takes one) image-to-video requests, with per-token timesteps (0 on the
    first frame's tokens), and text-to-video requests (per-token too) create no graph and equal the eager
    stage within 1e-4."""
    from tests.diffusion.test_compile_warmup import _graphs
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.lora.request import RequestAdapter

    def engine(**kw) -> DiffusionEngine:
        return DiffusionEngine(
            OmniDiffusionConfig(
                model=str(ti2v_dir),
                dtype="float32",
                device="cpu",
                enable_progress_bar=False,
                max_loras=2,
                **kw,
            )
        )

    compiled = engine(enforce_eager=False, compile_backend="eager", compile_cache_dir=str(tmp_path))
    eager = engine(enforce_eager=True)
    lora = LoRARequest("a", 1, adapter)
    try:
        assert compiled.worker.warm_up[0] >= 3  # warmed up at start, by default
        start = _graphs()
        requests = [  # (prompts, adapter sets, extra_args, guidance): CFG / one row, padded texts, LoRA
            ([PROMPT], [()], {"image": _image(0)}, 3.0),
            ([PROMPT, "a red ball"], [(RequestAdapter(lora, SCALE),), ()], {"image": _image(1)}, 3.0),
            ([PROMPT], [(RequestAdapter(lora, 1.0),)], {"image": _image(0)}, 0.0),
            ([PROMPT, PROMPT], [()] * 2, {}, 3.0),
            (["a red ball"], [()], {}, 0.0),
        ]
        outs = []
        for prompts, sets, extra, guidance in requests:
            sp = _sp(**extra)
            sp.guidance_scale = guidance
            got, want = (
                torch.cat([o.latents for o in e.worker.generate_batch(prompts, sp, sets)])
                for e in (compiled, eager)
            )
            assert _err(got, want) <= TOL, (prompts, sorted(extra), guidance)
            outs.append(got)
        assert _err(outs[0], outs[3][:1]) > 0.1  # the image conditioning was applied
        assert _graphs() == start, "a TI2V request after the warm-up compiled a new graph"
    finally:
        compiled.shutdown()
        eager.shutdown()


def test_a_ti2v_folder_naming_the_image_to_video_class_needs_the_image(ti2v_dir, reference, tmp_path):
    """The same weights under ``_class_name: "WanImageToVideoPipeline"`` (as diffusers' class, the image is
    required): the stage describes the image as required, a request without one is refused naming
    ``extra_args['image']``, and one with it equals diffusers' image-to-video latents."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.diffusion.models.wan.pipeline_i2v import WanImageToVideoPipeline

    folder = tmp_path / "ti2v-i2v-class"
    folder.mkdir()
    for entry in ti2v_dir.iterdir():
        if entry.is_dir():
            (folder / entry.name).symlink_to(entry)
    index = json.loads((ti2v_dir / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanImageToVideoPipeline"}))
    config = OmniDiffusionConfig(model=str(folder), dtype="float32", device="cpu", enable_progress_bar=False)
    engine = DiffusionEngine(config)
    try:
        assert isinstance(engine.worker.pipeline, WanImageToVideoPipeline)
        info = engine.collective_rpc("describe")[0]
        assert info["accepts_image"] and not info["image_optional"]
        with pytest.raises(InvalidRequestError, match=r"needs an input image: pass extra_args\['image'\]"):
            engine.worker.generate([PROMPT], _sp())
        [out] = engine.worker.generate([PROMPT], _sp(image=_image(0)))
    finally:
        engine.shutdown()
    assert _err(out.latents, reference["latents"]) <= TOL
