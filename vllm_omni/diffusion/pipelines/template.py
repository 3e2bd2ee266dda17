"""The one ``generate`` every in-tree DiT family runs: :class:`DiTPipeline` and the request options it parses.

A family (``vllm_omni/diffusion/models/<family>/``: its spec, denoiser and pipeline) subclasses
:class:`DiTPipeline` and fills in hooks; the order of work, the request options, the CFG row layout
reported to LoRA, the noise, the schedule checks and the loop are written here once::

    options = parse_options(sp)                       # the same request options for every family
    condition = prepare_condition(sp, options)        # input image(s) (default: none)
    height, width = resolve_size(sp, condition)
    scheduler = schedule(options, noise_shape)        # refused here when not finite
    text = encode_texts(encode_prompts, ...)          # prompts (+ negatives with CFG) in the text-encoder LoRA scope
    state = DenoiseState(...)                         # what every step needs, built once
    latents = init_latents(noise, state)
    for each step:  latents = scheduler.step(denoise_step(state, latents, timesteps, step_index), ...)
    latents = finish_latents(latents, state); decode_into(results, latents, state)

Hooks a family defines (see each method's docstring): ``load_components``, ``default_guidance``,
``cfg_enabled``, ``family_options``, ``resolve_size``, ``prepare_condition``, ``noise_shape``,
``schedule_kwargs``, ``encode_prompts``, ``repeat_text``, ``init_latents``, ``predict`` (the denoiser
call(s) of one step on ``[positive rows; negative rows]``), ``combine_cfg``, ``finish_latents``,
``decode_into``. :meth:`DiTPipeline.denoise_step` is the whole per-step body as one callable unit: given
the rows' latents, each row's timestep and step index, it returns each row's velocity; rows may carry
different timesteps (step-level batching builds on it).

Request options (:class:`RequestOptions`): size, ``num_images_per_prompt``, steps, ``guidance_scale``,
``negative_prompt``, seeds, adapters (through ``lora_context``) and in ``extra_args``:
``attention_kwargs`` / ``joint_attention_kwargs`` ``{"scale": s}`` (the LoRA scale of the call, every
family), ``true_cfg_scale`` (an alias of ``guidance_scale``, every family), ``guidance_scale_2`` (families
with two experts) and the family's own keys (``extra_args_taken``: ``num_frames``, ``image``...). Anything
else is refused, named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.forward_context import denoising_step, set_forward_context
from vllm_omni.diffusion.pipelines.base import LoRAContextFactory
from vllm_omni.diffusion.pipelines.denoise import (
    InTreePipelineBase,
    check_finite_latents,
    denoiser_rows,
    encode_texts,
    lora_scope,
    prepare_scheduler,
    seeded_noise,
    split_by_prompt,
)
from vllm_omni.diffusion.pipelines.diffusers_fallback import pop_lora_scale
from vllm_omni.diffusion.progress import step_progress
from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

#: ``extra_args`` every family takes (besides the LoRA-scale dicts :func:`pop_lora_scale` reads)
COMMON_EXTRA_ARGS = ("true_cfg_scale", "guidance_scale_2")


@dataclass
class RequestOptions:
    """A request's settings, parsed once (:meth:`DiTPipeline.parse_options`).

    Attributes:
        steps: ``num_inference_steps``. n: ``num_images_per_prompt``.
        guidance: the CFG scale (request, ``extra_args["true_cfg_scale"]``, else the family default).
        guidance_2: the low-noise expert's scale (two-expert families; default ``guidance``).
        cfg: whether the negative branch runs (the family's :meth:`DiTPipeline.cfg_enabled`).
        lora_scale: the call-wide LoRA multiplier (``attention_kwargs={"scale": s}``), 1 = none.
        extra: the family's own ``extra_args`` (validated by :meth:`DiTPipeline.family_options`).
        height, width: pixels, set once the size is resolved.
    """

    steps: int
    n: int
    guidance: float
    guidance_2: float
    cfg: bool
    lora_scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)
    height: int = 0
    width: int = 0


@dataclass
class DenoiseState:
    """What every step of one call needs (built once per ``generate``).

    Attributes:
        options: the parsed request options. batch: positive rows ``B`` (prompts x n).
        text: the family's encoded text for ``[B positive; B negative (with CFG)]`` rows.
        condition: the family's per-call conditioning (``None``: none).
        extra: anything else a family's hooks hand to its ``predict`` (shapes, masks...).
    """

    options: RequestOptions
    batch: int
    text: Any
    condition: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r:.80}")
    return float(value)


class DiTPipeline(InTreePipelineBase):
    """Base of the in-tree DiT pipelines: one ``generate`` template, per-family hooks (module docstring).

    Class attributes a family sets: ``family`` (its registry name), ``extra_args_taken`` (its own
    ``extra_args`` keys), ``two_experts`` (``guidance_scale_2`` accepted), ``output_kind`` /
    ``accepts_image`` (see :class:`~vllm_omni.diffusion.pipelines.base.DiffusionPipeline`).

    Hooks, in the order ``generate`` calls them (required ones marked *):

    ========================  ==================================================================
    ``default_guidance`` *    the CFG scale of a request that sets none
    ``cfg_enabled``           whether the negative branch runs (default ``guidance > 1``)
    ``family_options``        validate the family's own ``extra_args`` into ``options.extra``
    ``prepare_condition``     input image(s) before the size is known (default none)
    ``resolve_size`` *        ``(height, width)`` of the request
    ``noise_shape`` *         one sample's initial noise shape (as diffusers draws it)
    ``schedule_kwargs``       ``prepare_scheduler`` keywords (default ``steps=``)
    ``encode_prompts`` *      text features of prompts (+ negatives), in the text-encoder LoRA scope
    ``repeat_text``           each text row ``n`` times (default: tensors / tuples / lists)
    ``build_state``           more per-call data for ``predict`` (``state.extra``, ``state.condition``)
    ``init_latents``          the loop's start from the noise (default as is; e.g. packing)
    ``denoise_step``          the per-step unit: rows' latents + each row's timestep and step index
                              -> each row's velocity (calls the four hooks below)
    ``model_input``           the rows' denoiser input (default: latents in the denoiser dtype)
    ``predict`` *             the denoiser call(s) on ``[B positive; B negative]`` rows, float32
    ``combine_cfg``           the guided prediction (default ``neg + g * (pos - neg)``)
    ``to_velocity``           what ``scheduler.step`` takes (default as is)
    ``finish_latents``        the final latents handed on (default as is)
    ``decode_into`` *         decode and attach images / videos to the results
    ========================  ==================================================================
    """

    family: ClassVar[str] = ""
    extra_args_taken: tuple[str, ...] = ()
    two_experts: bool = False
    #: set by the family's ``__init__``: the (first) denoiser, its scheduler and VAE
    transformer: Any
    scheduler: Any

    # ------------------------------------------------------------------ request options
    def default_guidance(self) -> float:
        """The CFG scale of a request that sets none (diffusers' ``__call__`` default)."""
        raise NotImplementedError

    def cfg_enabled(self, guidance: float, sp: OmniDiffusionSamplingParams) -> bool:
        """Whether the negative branch runs (diffusers' rule for this family)."""
        return guidance > 1.0

    def family_options(self, extra: dict[str, Any], options: RequestOptions) -> None:
        """Validate the family's own ``extra_args`` (``extra`` holds only :attr:`extra_args_taken` keys);
        store what later hooks need in ``options.extra``. Raises InvalidRequestError on a bad value."""

    def parse_options(self, sp: OmniDiffusionSamplingParams) -> RequestOptions:
        """The request options of ``sp`` (module docstring), the same rules for every family.

        Raises:
            InvalidRequestError: an ``extra_args`` key no family hook takes (named), a bad value, or
                ``guidance_scale_2`` on a one-expert model.
        """
        extra = dict(sp.extra_args)
        lora_scale = pop_lora_scale(extra)
        for key in ("attention_kwargs", "joint_attention_kwargs"):
            if extra.get(key):
                raise InvalidRequestError(
                    f"extra_args[{key!r}] keys {sorted(extra[key])} are not used by the in-tree "
                    f"{type(self).__name__} (only 'scale', the LoRA scale of the call)"
                )
            extra.pop(key, None)
        taken = COMMON_EXTRA_ARGS + tuple(self.extra_args_taken)
        unknown = sorted(set(extra) - set(taken))
        if unknown:
            raise InvalidRequestError(
                f"extra_args {unknown} are not used by the in-tree {type(self).__name__} (it takes "
                f"{list(taken)} and attention_kwargs={{'scale': s}}); run the stage with "
                "pipeline_backend='diffusers' to pass other diffusers arguments"
            )
        guidance = extra.pop("true_cfg_scale", sp.guidance_scale)
        guidance = (
            self.default_guidance() if guidance is None else _number("extra_args['true_cfg_scale']", guidance)
        )
        guidance_2 = extra.pop("guidance_scale_2", None)
        if guidance_2 is not None and not self.two_experts:
            raise InvalidRequestError(
                "extra_args['guidance_scale_2'] needs a two-expert model (boundary_ratio)"
            )
        guidance_2 = guidance if guidance_2 is None else _number("extra_args['guidance_scale_2']", guidance_2)
        options = RequestOptions(
            steps=sp.num_inference_steps,
            n=sp.num_images_per_prompt,
            guidance=guidance,
            guidance_2=guidance_2,
            cfg=self.cfg_enabled(guidance, sp),
            lora_scale=lora_scale,
        )
        self.family_options(extra, options)
        return options

    # ------------------------------------------------------------------ hooks (sizes, inputs, schedule)
    def resolve_size(self, sp: OmniDiffusionSamplingParams, condition: Any) -> tuple[int, int]:
        """``(height, width)`` in pixels (request's, else the family default). Raises InvalidRequestError."""
        raise NotImplementedError

    def prepare_condition(self, sp: OmniDiffusionSamplingParams, options: RequestOptions) -> Any:
        """The request's input image(s) made ready before the size is known (default: none)."""
        return None

    def noise_shape(self, options: RequestOptions, condition: Any) -> tuple[int, ...]:
        """Shape of one sample's initial noise (as diffusers draws it)."""
        raise NotImplementedError

    def schedule_kwargs(self, options: RequestOptions, noise_shape: tuple[int, ...]) -> dict[str, Any]:
        """``prepare_scheduler`` keywords: ``steps=`` or ``sigmas=`` (and ``mu=``). Default: ``steps``."""
        return {"steps": options.steps}

    # ------------------------------------------------------------------ hooks (text, latents, steps)
    def encode_prompts(self, texts: list[str], options: RequestOptions, sp, condition: Any) -> Any:
        """The text features of ``texts`` (prompts, then negatives with CFG)."""
        raise NotImplementedError

    def repeat_text(self, text: Any, n: int) -> Any:
        """``text`` with each row repeated ``n`` times (tensors: ``repeat_interleave``; lists: per item)."""
        if isinstance(text, torch.Tensor):
            return text.repeat_interleave(n, dim=0)
        if isinstance(text, tuple):
            return tuple(self.repeat_text(t, n) for t in text)
        return [t for t in text for _ in range(n)]

    def build_state(self, state: DenoiseState, sp: OmniDiffusionSamplingParams) -> None:
        """Add to ``state.extra`` what ``predict`` needs beyond text and condition (default: nothing)."""

    def init_latents(self, noise: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        """The loop's starting latents from the drawn ``noise`` ``(B, *noise_shape)`` (default: as is)."""
        return noise

    def predict(self, state: DenoiseState, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The denoiser's float32 output on ``x`` (``[B positive; B negative]`` rows with CFG, in the
        denoiser dtype) at ``timesteps`` (scheduler units, one per row of ``x``)."""
        raise NotImplementedError

    def combine_cfg(self, state: DenoiseState, out: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The guided prediction from ``out`` ``[pos; neg]``; default ``neg + g * (pos - neg)``."""
        batch = out.shape[0] // 2
        pos, neg = out[:batch], out[batch:]
        return neg + state.options.guidance * (pos - neg)

    def model_input(
        self, state: DenoiseState, latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """The denoiser input of the rows (default: ``latents`` in the denoiser dtype)."""
        return latents.to(self.transformer.dtype)

    def to_velocity(self, pred: torch.Tensor) -> torch.Tensor:
        """What ``scheduler.step`` takes from the guided prediction (default: as is)."""
        return pred

    def finish_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        """The final latents handed on (default: as is)."""
        return latents

    def decode_into(
        self, results: list[DiffusionOutput], latents: torch.Tensor, state: DenoiseState, sp
    ) -> None:
        """Decode ``latents`` and give each result its ``n`` images / videos."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the per-step unit
    def denoise_step(
        self, state: DenoiseState, latents: torch.Tensor, timesteps: torch.Tensor, step_index: list[int]
    ) -> torch.Tensor:
        """One denoising step of ``B`` rows: ``latents`` ``(B, ...)`` float32, ``timesteps`` ``(B,)`` (each
        row's, scheduler units), ``step_index`` (each row's). Runs the denoiser on the rows (and with CFG
        their negative copies, one batch) and returns each row's velocity for ``scheduler.step``, float32.
        The LoRA scope and the forward context are the caller's."""
        x = self.model_input(state, latents, timesteps)
        t = timesteps
        if state.options.cfg:
            x, t = torch.cat([x, x]), torch.cat([timesteps, timesteps])
        out = self.predict(state, x, t)
        pred = self.combine_cfg(state, out, timesteps) if state.options.cfg else out
        return self.to_velocity(pred)

    # ------------------------------------------------------------------ the template
    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        sp: OmniDiffusionSamplingParams,
        *,
        seeds: list[int | None] | None = None,
        lora_context: LoRAContextFactory | None = None,
    ) -> list[DiffusionOutput]:
        """``sp.num_images_per_prompt`` outputs per prompt, all prompts (and CFG branches) in one
        denoiser batch; see :class:`~vllm_omni.diffusion.pipelines.base.DiffusionPipeline`.

        Returns one :class:`DiffusionOutput` per prompt with float32 CPU ``latents`` (the family's
        layout, as diffusers' ``output_type="latent"``) and, unless ``output_type="latent"``, decoded output.

        Raises:
            InvalidRequestError: bad sizes, options, input images, negative prompt count; a schedule
                that is not finite (before any encoding); latents that end non-finite.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            return []
        options = self.parse_options(sp)
        condition = self.prepare_condition(sp, options)
        options.height, options.width = self.resolve_size(sp, condition)
        shape = self.noise_shape(options, condition)
        scheduler = prepare_scheduler(self.scheduler, self.device, **self.schedule_kwargs(options, shape))
        text = encode_texts(
            lambda texts: self.encode_prompts(texts, options, sp, condition),
            prompts,
            sp.negative_prompt,
            options.cfg,
            lora_context,
        )
        n = options.n
        state = DenoiseState(options, len(prompts) * n, self.repeat_text(text, n), condition)
        self.build_state(state, sp)
        latents = self.init_latents(seeded_noise(shape, n, sp, len(prompts), seeds, self.device), state)
        adapters = lora_scope(lora_context, denoiser_rows(len(prompts), n, options.cfg), options.lora_scale)
        timesteps = scheduler.timesteps
        with adapters, set_forward_context():
            progress = step_progress(timesteps, len(timesteps), "denoise", self.od_config.enable_progress_bar)
            for i, t in enumerate(progress):
                with denoising_step(i, len(timesteps)):
                    velocity = self.denoise_step(state, latents, t.expand(state.batch), [i] * state.batch)
                latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
        check_finite_latents(latents, len(timesteps))
        latents = self.finish_latents(latents, state)
        results = split_by_prompt(prompts, latents, n)
        if sp.output_type != "latent":
            self.decode_into(results, latents, state, sp)
        return results


__all__ = ["COMMON_EXTRA_ARGS", "DenoiseState", "DiTPipeline", "RequestOptions"]
