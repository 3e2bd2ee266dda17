"""The DiT family contract: every registered family, on a tiny folder built from each published checkpoint it
claims, equals diffusers (+ its LoRA loader, peft underneath) on the same weights for the requests users send.

Parametrised over the registry (:mod:`vllm_omni.config.dit_families`): a family joins with its folder, its
registry line, its spec's ``PUBLISHED`` list and a builder in ``tools/make_tiny_dit.py``; nothing here names
a family. Checkpoints whose behaviour-selecting records are identical (Qwen-Image and Qwen-Image-2512) share
one folder. Per checkpoint one in-tree worker and one diffusers pipeline serve every variant:

* ``mixed``: three prompts of different lengths in one batch, a negative prompt, CFG on, two outputs per
  prompt, per-prompt seeds, a non-square size; one row with an adapter (scale 0.8) next to one without and
  one with a per-step schedule ``[1.0, 0.3]`` (on Wan2.2 A14B the two steps run on the two experts).
  Each row == diffusers with the same adapter setting; the adapter-free row equals bit for bit the same
  batch run with no adapter at all.
* ``one_step``: CFG off, one step (refused, naming the field, where the published scheduler's
  ``shift_terminal`` makes one step 0/0), scale 0 next to a negative scale in one batch.

Float32, tolerance 1e-4 on the final latents (diffusers' ``output_type="latent"`` layout).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_omni.config.dit_families import family_specs
from vllm_omni.errors import InvalidRequestError

pytestmark = [pytest.mark.slow]
TOL = 1e-4
HEIGHT, WIDTH = 32, 64
FRAMES = 5
PROMPTS = ["a red cat on the mat and a blue ball", "a dog"]
NEG = "blurry"
SEEDS = [11, 12]


def _cases() -> list[tuple[Any, Any, str]]:
    """``(family spec, checkpoint, test id)``, one per distinct published record."""
    cases, seen = [], {}
    for spec in family_specs().values():
        for cp in spec.published:
            key = json.dumps([spec.name, cp.model_index(), cp.scheduler, cp.denoiser], sort_keys=True)
            digest = hashlib.sha256(key.encode()).hexdigest()
            if digest in seen:
                seen[digest][2] += f"+{cp.name}"
                continue
            seen[digest] = [spec, cp, f"{spec.name}:{cp.name}"]
            cases.append(seen[digest])
    return [tuple(c) for c in cases]


CASES = _cases()


@dataclass
class Case:
    spec: Any
    checkpoint: Any
    folder: Path
    worker: Any
    ref: Any
    lora: Any

    @property
    def video(self) -> bool:
        return self.spec.output_kind == "video"

    def image_required(self) -> bool:
        return self.spec.image_inputs.get(self.checkpoint.pipeline) == "required"

    @property
    def outputs_per_prompt(self) -> int:
        """2, or 1 where diffusers' reference cannot make two (a component the spec names is present)."""
        single = self.spec.contract.get("reference_n1_components", ())
        return 1 if any(c in self.checkpoint.components for c in single) else 2

    def call_kwargs(self) -> dict[str, Any]:
        """Call settings both sides take (``contract["max_sequence_length"]``: a shorter padded prompt)."""
        length = self.spec.contract.get("max_sequence_length")
        return {} if length is None else {"max_sequence_length": length}

    def cfg_scale(self, on: bool) -> float:
        return self.spec.cfg_threshold + 3.0 if on else self.spec.cfg_threshold

    def inputs(self) -> dict[str, Any]:
        """Family inputs both sides take: frames for video, an input image where the class needs one."""
        out: dict[str, Any] = {"num_frames": FRAMES} if self.video else {}
        if self.image_required():
            out["image"] = _image()
        return out


def _image():
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    pixels = (torch.rand(HEIGHT, WIDTH, 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(pixels)


def _write_adapter(folder: Path, ref, out: Path) -> Path:
    """A rank-4 LoRA (alpha 4) on the attention q/k/v of the (high-noise) denoiser, diffusers' file layout."""
    from tests.diffusion.lora_oracle import save_random_diffusers_lora

    model = type(ref.transformer).from_pretrained(str(folder / "transformer"))
    return save_random_diffusers_lora(model, type(ref), ["to_q", "to_k", "to_v"], 21, out, r=4, alpha=4)


@pytest.fixture(scope="module", params=CASES, ids=[c[2] for c in CASES])
def case(request, tmp_path_factory):
    from diffusers import DiffusionPipeline

    from tests.conftest import test_assets_root
    from tools.make_tiny_dit import ensure_tiny_published
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.worker import DiffusionWorker
    from vllm_omni.lora.request import LoRARequest

    spec, checkpoint, name = request.param
    folder = ensure_tiny_published(test_assets_root(), checkpoint, spec.name)
    patch = pytest.MonkeyPatch()
    area = spec.contract.get("condition_area")
    if area:  # diffusers' sizing of an input image, at the tiny area
        module, fn = area[1].split(":")
        original = getattr(importlib.import_module(module), fn)
        patch.setattr(importlib.import_module(module), fn, lambda _area, ratio: original(area[0], ratio))
    loaded = {
        comp: _resolve(target)(str(folder / comp))
        for comp, target in spec.contract.get("reference_loaders", {}).items()
        if comp in checkpoint.components
    }
    ref = DiffusionPipeline.from_pretrained(str(folder), **loaded)
    ref.set_progress_bar_config(disable=True)
    module = sys.modules[type(ref).__module__]
    if not hasattr(module, "ftfy") and "ftfy" in vars(module).get("basic_clean", lambda: 0).__code__.co_names:
        # ftfy is not installed here: diffusers' text cleaning without it (the in-tree side uses the same)
        patch.setattr(module, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)
    adapter = _write_adapter(folder, ref, tmp_path_factory.mktemp("contract_lora"))
    ref.load_lora_weights(str(adapter), adapter_name="a")
    config = OmniDiffusionConfig(
        model=str(folder), dtype="float32", device="cpu", enable_progress_bar=False, max_loras=2
    )
    worker = DiffusionWorker(config)
    assert type(worker.pipeline).__name__ == checkpoint.pipeline  # served in-tree, by the family's class
    if area and hasattr(worker.pipeline, "condition_area"):
        worker.pipeline.condition_area = area[0]
    yield Case(spec, checkpoint, folder, worker, ref, LoRARequest("a", 1, str(adapter)))
    patch.undo()
    del worker


def _resolve(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _in_tree(case: Case, prompts, *, steps, cfg, adapters, seeds, n=1) -> list[torch.Tensor]:
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.lora.request import RequestAdapter, RequestAdapters

    sp = OmniDiffusionSamplingParams(
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=steps,
        guidance_scale=case.cfg_scale(cfg),
        negative_prompt=NEG if cfg else None,
        num_images_per_prompt=n,
        output_type="latent",
        extra_args=case.inputs(),
        **case.call_kwargs(),
    )
    sets = [
        RequestAdapters() if s is None else RequestAdapters((RequestAdapter(case.lora, s),)) for s in adapters
    ]
    outs = case.worker.generate_batch(list(prompts), sp, sets, seeds=list(seeds))
    for out in outs:
        if isinstance(out, BaseException):
            raise out
    return [torch.as_tensor(o.latents).float() for o in outs]


@torch.no_grad()
def _diffusers(case: Case, prompt, *, steps, cfg, scale, seed, n=1) -> torch.Tensor:
    """diffusers' latents; ``scale``: the adapter's (``None``: no adapter; a list: per step)."""
    ref = case.ref
    kwargs: dict[str, Any] = {}
    if scale is None:
        ref.disable_lora()
    else:
        ref.enable_lora()
        steps_scales = scale if isinstance(scale, list) else [scale] * steps
        ref.set_adapters(["a"], [steps_scales[0]])

        def step_end(_pipe, i, _t, _kw):
            if i + 1 < steps:
                ref.set_adapters(["a"], [steps_scales[i + 1]])
            return {}

        kwargs["callback_on_step_end"] = step_end
    if cfg:
        kwargs["negative_prompt"] = NEG
    kwargs.update(case.call_kwargs())
    kwargs[case.spec.guidance_argument] = case.cfg_scale(cfg)
    per_prompt = (
        "num_images_per_prompt" if "num_images_per_prompt" in _parameters(ref) else "num_videos_per_prompt"
    )
    kwargs[per_prompt] = n
    out = ref(
        prompt=prompt,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
        return_dict=False,
        **case.inputs(),
        **kwargs,
    )[0]
    return out.float()


def _parameters(pipe) -> set[str]:
    import inspect

    return set(inspect.signature(type(pipe).__call__).parameters)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_mixed_batch_cfg_two_outputs_adapter_row_beside_base_row_and_a_schedule(case):
    from vllm_omni.lora.schedule import LoRAScaleSchedule

    n, prompts, seeds = case.outputs_per_prompt, [*PROMPTS, "a green ball on the grass"], [*SEEDS, 13]
    schedule = LoRAScaleSchedule.parse([1.0, 0.3])
    got = _in_tree(case, prompts, steps=2, cfg=True, adapters=[0.8, None, schedule], seeds=seeds, n=n)
    base = _in_tree(case, prompts, steps=2, cfg=True, adapters=[None, None, None], seeds=seeds, n=n)
    assert torch.equal(got[1], base[1])  # the row without an adapter is the base, exactly
    with_adapter = _diffusers(case, prompts[0], steps=2, cfg=True, scale=0.8, seed=seeds[0], n=n)
    without = _diffusers(case, prompts[1], steps=2, cfg=True, scale=None, seed=seeds[1], n=n)
    scheduled = _diffusers(case, prompts[2], steps=2, cfg=True, scale=[1.0, 0.3], seed=seeds[2], n=n)
    assert _err(got[0], with_adapter) <= TOL
    assert _err(got[1], without) <= TOL
    assert _err(got[2], scheduled) <= TOL
    assert _err(base[0], with_adapter) > 10 * TOL  # the adapter matters


def test_one_step_cfg_off_scale_zero_beside_negative_scale(case):
    steps = 1
    if case.checkpoint.scheduler.get("shift_terminal"):
        with pytest.raises(InvalidRequestError, match=r"num_inference_steps=1 .*shift_terminal"):
            _in_tree(case, PROMPTS, steps=1, cfg=False, adapters=[0.0, -0.7], seeds=SEEDS)
        steps = 2  # the published schedule's smallest
    got = _in_tree(case, PROMPTS, steps=steps, cfg=False, adapters=[0.0, -0.7], seeds=SEEDS)
    assert (
        _err(got[0], _diffusers(case, PROMPTS[0], steps=steps, cfg=False, scale=None, seed=SEEDS[0])) <= TOL
    )
    assert (
        _err(got[1], _diffusers(case, PROMPTS[1], steps=steps, cfg=False, scale=-0.7, seed=SEEDS[1])) <= TOL
    )


VARIANT_CASES = [
    (spec, variant)
    for spec in family_specs().values()
    for variant in spec.variants
    if isinstance(variant.served, tuple) and spec.published
]


@pytest.mark.parametrize(
    ("spec", "variant"), VARIANT_CASES, ids=[f"{s.name}:{v.file}:{v.key}" for s, v in VARIANT_CASES]
)
def test_a_variant_the_family_does_not_serve_is_refused_at_start(spec, variant, tmp_path):
    """A published folder with one variant key set to a value the family does not serve: refused when the
    stage's config is built (before anything loads), naming the folder, the file and key, and the value."""
    from vllm_omni.config.diffusion import OmniDiffusionConfig
    from vllm_omni.errors import ConfigError

    checkpoint = spec.published[0]
    (tmp_path / "model_index.json").write_text(json.dumps(checkpoint.model_index()))
    for component in checkpoint.components:
        (tmp_path / component).mkdir()
    path = tmp_path / variant.file
    document = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**document, variant.key: "not-a-served-value"}))
    with pytest.raises(ConfigError) as err:
        OmniDiffusionConfig(model=str(tmp_path))
    message = str(err.value)
    for part in (str(tmp_path), variant.file, f"{variant.key}='not-a-served-value'"):
        assert part in message, message
