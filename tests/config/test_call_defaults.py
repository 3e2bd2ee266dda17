"""The steps and guidance of a request that sets none: stage option, then the model's ``_call_defaults``, then
the pipeline class's ``__call__`` defaults (``vllm_omni.config.call_defaults``); the in-tree pipelines' own
fallbacks and the HTTP body agree with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_omni.config.call_defaults import CallDefaults, call_defaults
from vllm_omni.config.diffusion import OmniDiffusionConfig
from vllm_omni.errors import ConfigError

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo_model"


def model(tmp_path: Path, class_name: str, **extra) -> Path:
    """A model directory of ``class_name`` with no components (enough for the config checks)."""
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": class_name, **extra}))
    return tmp_path


def defaults(path, **options) -> CallDefaults:
    return call_defaults(OmniDiffusionConfig(**options).with_model(path))


def test_the_in_tree_pipelines_fall_back_to_their_classes_call_defaults(tmp_path):
    """What an in-tree pipeline does with ``guidance_scale=None`` and what ``OmniDiffusionSamplingParams``
    runs by default are the class's ``__call__`` defaults: one source for the server and the engine."""
    from vllm_omni.diffusion.models.qwen_image import pipeline as qwen_image
    from vllm_omni.diffusion.models.wan import pipeline as wan
    from vllm_omni.diffusion.models.z_image import pipeline as z_image
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    steps = OmniDiffusionSamplingParams().num_inference_steps
    for class_name, fallback in (
        ("ZImagePipeline", z_image.DEFAULT_GUIDANCE),
        ("QwenImagePipeline", qwen_image.DEFAULT_TRUE_CFG),  # the request's guidance is its true CFG scale
        ("WanPipeline", wan.DEFAULT_GUIDANCE),
    ):
        (tmp_path / class_name).mkdir()
        got = defaults(model(tmp_path / class_name, class_name))
        assert (got.num_inference_steps, got.guidance_scale) == (steps, fallback), class_name
        assert got.steps_from == got.guidance_from == f"{class_name}.__call__"


def test_the_backend_decides_which_argument_guidance_stands_for(tmp_path):
    qwen = model(tmp_path, "QwenImagePipeline")
    in_tree, diffusers = defaults(qwen), defaults(qwen, pipeline_backend="diffusers")
    # in-tree: true CFG (4.0); diffusers' own guidance_scale of Qwen-Image is its distilled embedding (None)
    assert (in_tree.guidance_scale, diffusers.guidance_scale) == (4.0, None)
    assert diffusers.guidance_from == "the pipeline" and diffusers.as_dict()["guidance_scale"] is None


def test_a_diffusers_only_class_gives_its_own_defaults(tmp_path):
    flux = defaults(model(tmp_path, "FluxPipeline"))
    assert (flux.num_inference_steps, flux.guidance_scale) == (28, 3.5)  # not OmniDiffusionSamplingParams' 50


def test_the_model_and_the_stage_options_override_the_class():
    demo = call_defaults(OmniDiffusionConfig().with_model(DEMO))
    declared = json.loads((DEMO / "model_index.json").read_text())["_call_defaults"]
    # what tools/train_demo_model.py writes (its README's suggested settings), not ZImagePipeline's 50 / 5.0
    from tools.train_demo_model import SUGGESTED_GUIDANCE, SUGGESTED_STEPS

    assert (
        (demo.num_inference_steps, demo.guidance_scale) == (SUGGESTED_STEPS, SUGGESTED_GUIDANCE) == (12, 3.0)
    )
    assert declared == {"num_inference_steps": SUGGESTED_STEPS, "guidance_scale": SUGGESTED_GUIDANCE}
    assert demo.steps_from == demo.guidance_from == "model_index.json _call_defaults"
    staged = call_defaults(OmniDiffusionConfig(default_num_inference_steps=4).with_model(DEMO))
    assert (staged.num_inference_steps, staged.guidance_scale) == (4, 3.0)
    assert staged.steps_from == "stage option default_num_inference_steps"
    both = call_defaults(OmniDiffusionConfig(default_guidance_scale=0, default_num_inference_steps=2))
    assert (both.num_inference_steps, both.guidance_scale) == (2, 0.0)  # no model: the options alone


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ([12], "must be an object"),
        ({"steps": 12}, r"unknown keys \['steps'\]"),
        ({"num_inference_steps": 0}, r"num_inference_steps must be an integer in \[1, 1000\], got 0"),
        ({"guidance_scale": "high"}, r"guidance_scale must be a number in \[0, 100\], got 'high'"),
    ],
)
def test_a_bad_model_declaration_is_refused_naming_the_file(tmp_path, declared, message):
    with pytest.raises(ConfigError, match="model_index.json _call_defaults.*" + message):
        defaults(model(tmp_path, "ZImagePipeline", _call_defaults=declared))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"default_num_inference_steps": 1.5},
            r"^default_num_inference_steps must be an integer in \[1, 1000\]",
        ),
        ({"default_guidance_scale": float("nan")}, r"^default_guidance_scale must be a number in \[0, 100\]"),
    ],
)
def test_bad_stage_options_are_refused(options, message):
    with pytest.raises(ConfigError, match=message + r".*\(or unset: the model's\)$") as info:
        OmniDiffusionConfig(**options)
    assert info.value.options == tuple(options)


def test_a_request_body_takes_the_defaults_only_for_what_it_leaves_unset():
    from vllm_omni.entrypoints.openai.protocol import ImageGenerationRequest

    stage = CallDefaults(num_inference_steps=12, guidance_scale=3.0)
    unset = ImageGenerationRequest(prompt="a").diffusion_params(1, stage)
    assert (unset.num_inference_steps, unset.guidance_scale) == (12, 3.0)
    given = ImageGenerationRequest(prompt="a", num_inference_steps=5, guidance_scale=0).diffusion_params(
        1, stage
    )
    assert (given.num_inference_steps, given.guidance_scale) == (5, 0.0)
    none = ImageGenerationRequest(prompt="a").diffusion_params(1, CallDefaults(num_inference_steps=7))
    assert (none.num_inference_steps, none.guidance_scale) == (7, None)  # None: the pipeline's own
