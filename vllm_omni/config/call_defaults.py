"""The steps and guidance a diffusion stage runs when a request leaves them unset: one source.

The HTTP server fills a request's unset ``num_inference_steps`` / ``guidance_scale`` with
:func:`call_defaults` of the stage, and the ``/ui`` page shows the same values (``GET /ui/info``
``defaults``). Each value comes from the first of:

1. the stage options ``default_num_inference_steps`` / ``default_guidance_scale``
   (``--stage-overrides '{"0": {"default_num_inference_steps": 8}}'`` or a deploy YAML);
2. the model directory's own suggestion: ``model_index.json`` key ``"_call_defaults"``, e.g.
   ``{"num_inference_steps": 12, "guidance_scale": 3.0}`` (diffusers ignores keys that start with
   ``_``; ``tools/train_demo_model.py`` writes the demo model's);
3. the defaults of the pipeline class's ``__call__`` (the diffusers class named by ``_class_name``,
   read with :func:`inspect.signature`): ``num_inference_steps`` and the argument the request's
   ``guidance_scale`` reaches: ``true_cfg_scale`` for the in-tree Qwen-Image pipelines (their CFG
   scale), ``guidance_scale`` otherwise;
4. 50 steps and no guidance value (``None``: the pipeline's own) for a class diffusers lacks.

Only the standard library is imported at module level (the config package never imports diffusers
at import time; :func:`signature_defaults` imports it when first asked).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, replace
from typing import Any

from vllm_omni.errors import ConfigError

#: The ``model_index.json`` key of a model's suggested call settings.
MODEL_INDEX_KEY = "_call_defaults"
#: Steps of a class whose ``__call__`` is unknown (``OmniDiffusionSamplingParams``' default).
FALLBACK_STEPS = 50
#: Upper bounds, as a request's (``vllm_omni.entrypoints.openai.protocol``).
MAX_DEFAULT_STEPS = 1000
MAX_DEFAULT_GUIDANCE = 100.0
#: In-tree pipeline class -> the ``__call__`` argument a request's ``guidance_scale`` stands for.
IN_TREE_GUIDANCE_ARGUMENT = {
    "QwenImagePipeline": "true_cfg_scale",
    "QwenImageEditPipeline": "true_cfg_scale",
}


@dataclass(frozen=True)
class CallDefaults:
    """What a request that sets no ``num_inference_steps`` / ``guidance_scale`` runs with.

    Attributes:
        num_inference_steps: denoising steps.
        guidance_scale: the request's ``guidance_scale`` (``None``: the pipeline's own handling).
        steps_from / guidance_from: where each value came from, for people (e.g.
            ``"stage option default_num_inference_steps"``, ``"model_index.json _call_defaults"``,
            ``"ZImagePipeline.__call__"``).
    """

    num_inference_steps: int = FALLBACK_STEPS
    guidance_scale: float | None = None
    steps_from: str = "OmniDiffusionSamplingParams"
    guidance_from: str = "the pipeline"

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "from": {"num_inference_steps": self.steps_from, "guidance_scale": self.guidance_from},
        }


def check_steps(value: Any, where: str) -> int:
    """``value`` as default steps: an integer in ``[1, MAX_DEFAULT_STEPS]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DEFAULT_STEPS:
        raise ConfigError(f"{where} must be an integer in [1, {MAX_DEFAULT_STEPS}], got {value!r}")
    return value


def check_guidance(value: Any, where: str) -> float:
    """``value`` as a default guidance scale: a finite number in ``[0, MAX_DEFAULT_GUIDANCE]``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 <= value <= MAX_DEFAULT_GUIDANCE
    ):
        raise ConfigError(f"{where} must be a number in [0, {MAX_DEFAULT_GUIDANCE:g}], got {value!r}")
    return float(value)


@functools.lru_cache(maxsize=64)
def signature_defaults(class_name: str, guidance_argument: str) -> CallDefaults | None:
    """The ``__call__`` defaults of the diffusers class ``class_name`` (``None``: diffusers has no such
    class); ``guidance_argument`` names the argument the request's ``guidance_scale`` stands for."""
    import diffusers

    cls = getattr(diffusers, class_name, None) if class_name else None
    if not isinstance(cls, type):
        return None
    try:
        params = inspect.signature(cls.__call__).parameters
    except (TypeError, ValueError):  # no signature to read
        return None
    where = f"{class_name}.__call__"
    out = CallDefaults()
    steps = getattr(params.get("num_inference_steps"), "default", None)
    if isinstance(steps, int) and not isinstance(steps, bool):
        out = replace(out, num_inference_steps=steps, steps_from=where)
    guidance = getattr(params.get(guidance_argument), "default", None)
    if isinstance(guidance, int | float) and not isinstance(guidance, bool):
        out = replace(out, guidance_scale=float(guidance), guidance_from=where)
    return out


def model_index_defaults(model_index: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The checked ``"_call_defaults"`` of a ``model_index.json`` (``{}`` when it has none).

    Raises:
        ConfigError: the key is not an object, names other settings, or holds a bad value.
    """
    declared = model_index.get(MODEL_INDEX_KEY)
    if declared is None:
        return {}
    where = f"{model}/model_index.json {MODEL_INDEX_KEY}"
    if not isinstance(declared, dict):
        raise ConfigError(f"{where} must be an object, got {declared!r:.200}")
    unknown = sorted(set(declared) - {"num_inference_steps", "guidance_scale"})
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown} (it takes num_inference_steps, guidance_scale)")
    out: dict[str, Any] = {}
    if declared.get("num_inference_steps") is not None:
        out["num_inference_steps"] = check_steps(
            declared["num_inference_steps"], f"{where}.num_inference_steps"
        )
    if declared.get("guidance_scale") is not None:
        out["guidance_scale"] = check_guidance(declared["guidance_scale"], f"{where}.guidance_scale")
    return out


def call_defaults(config: Any) -> CallDefaults:
    """The :class:`CallDefaults` of a diffusion stage (module docstring), from its
    :class:`~vllm_omni.config.diffusion.OmniDiffusionConfig` bound to its model (``with_model``); a
    config without a model has the stage options and the fallbacks only.

    Raises:
        ConfigError: a bad ``"_call_defaults"`` in the model's ``model_index.json``.
    """
    base = CallDefaults()
    if config.model is not None:
        argument = (
            IN_TREE_GUIDANCE_ARGUMENT.get(config.class_name, "guidance_scale")
            if config.use_in_tree
            else "guidance_scale"
        )
        base = signature_defaults(config.class_name, argument) or base
        declared = model_index_defaults(config.model_index, config.model)
        where = f"model_index.json {MODEL_INDEX_KEY}"
        if "num_inference_steps" in declared:
            base = replace(base, num_inference_steps=declared["num_inference_steps"], steps_from=where)
        if "guidance_scale" in declared:
            base = replace(base, guidance_scale=declared["guidance_scale"], guidance_from=where)
    steps, guidance = config.default_num_inference_steps, config.default_guidance_scale
    if steps is not None:
        base = replace(base, num_inference_steps=steps, steps_from="stage option default_num_inference_steps")
    if guidance is not None:
        base = replace(
            base, guidance_scale=float(guidance), guidance_from="stage option default_guidance_scale"
        )
    return base
