"""The step unit of every pipeline on the DiT template (:mod:`vllm_omni.diffusion.pipelines.template`).

A request is prepared exactly as :meth:`DiTPipeline.generate` prepares one prompt (options, condition,
size, schedule, text encoding in the text-encoder LoRA scope, the prompt's seeded noise, the family's
state), so a request stepped alone runs the template's own :meth:`DiTPipeline.denoise_step`. Requests
that share a call are laid out request after request, each as ``[n positive; n negative]`` rows; their
states are merged for the family's ``predict`` (text features concatenated in that order, tensors
zero-padded along the sequence to the longest, as a batch of prompts is padded; list entries of
``state.extra`` concatenated) and each request combines its own CFG branches with its own guidance
(``combine_cfg`` on its rows, ``to_velocity``).

Requests share a call only when their latents have the same shape, their other ``state.extra`` values
are equal, they carry no per-request conditioning (an input image: such a request runs its steps in a
call of its own) and, on a two-expert family, their steps need the same expert.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vllm_omni.diffusion.pipelines.denoise import (
    check_finite_latents,
    encode_texts,
    prepare_scheduler,
    seeded_noise,
    split_by_prompt,
)
from vllm_omni.diffusion.pipelines.step_unit import StepRows
from vllm_omni.diffusion.pipelines.template import DenoiseState

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.pipelines.base import LoRAContextFactory
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@dataclasses.dataclass
class _Request:
    state: DenoiseState
    sp: OmniDiffusionSamplingParams


def _empty(condition: Any) -> bool:
    """No per-request conditioning: ``None``, or a named tuple or dataclass whose every field is ``None``."""
    if condition is None:
        return True
    if isinstance(condition, tuple) and hasattr(condition, "_fields"):
        return all(value is None for value in condition)
    return dataclasses.is_dataclass(condition) and all(
        getattr(condition, f.name) is None for f in dataclasses.fields(condition)
    )


def merge_rows(parts: Sequence[Any]) -> Any:
    """The rows of several requests' text features as one batch (module docstring).

    Raises:
        TypeError: a feature type this function does not know how to join.
    """
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() >= 2 and any(p.shape[1:] != first.shape[1:] for p in parts):
            longest = max(p.shape[1] for p in parts)
            parts = [F.pad(p, (0, 0) * (p.dim() - 2) + (0, longest - p.shape[1])) for p in parts]
        return torch.cat(list(parts))
    if isinstance(first, tuple):
        return tuple(merge_rows(list(column)) for column in zip(*parts, strict=True))
    if isinstance(first, list):
        return [x for p in parts for x in p]
    raise TypeError(f"cannot join text features of type {type(first).__name__}")


class TemplateSteps:
    """The step unit of a loaded :class:`~vllm_omni.diffusion.pipelines.template.DiTPipeline`."""

    def __init__(self, pipeline: Any) -> None:
        self.pipe = pipeline

    @torch.no_grad()
    def prepare(
        self,
        prompt: str,
        sp: OmniDiffusionSamplingParams,
        seed: int | None,
        lora_context: LoRAContextFactory | None,
    ) -> StepRows:
        pipe = self.pipe
        options = pipe.parse_options(sp)
        condition = pipe.prepare_condition(sp, options)
        options.height, options.width = pipe.resolve_size(sp, condition)
        shape = pipe.noise_shape(options, condition)
        scheduler = prepare_scheduler(pipe.scheduler, pipe.device, **pipe.schedule_kwargs(options, shape))
        text = encode_texts(
            lambda texts: pipe.encode_prompts(texts, options, sp, condition),
            [prompt],
            sp.negative_prompt,
            options.cfg,
            lora_context,
        )
        n = options.n
        state = DenoiseState(options, n, pipe.repeat_text(text, n), condition)
        pipe.build_state(state, sp)
        latents = pipe.init_latents(seeded_noise(shape, n, sp, 1, [seed], pipe.device), state)
        return StepRows(latents, scheduler, rows=n * (2 if options.cfg else 1), state=_Request(state, sp))

    def lora_scale(self, rows: StepRows) -> float:
        """The request's call-wide LoRA scale (``attention_kwargs={"scale": s}``; 1 = none)."""
        return rows.state.state.options.lora_scale

    def key(self, rows: StepRows) -> tuple:
        state = rows.state.state
        if not _empty(state.condition):
            return ("alone", id(rows))
        shared = tuple(sorted((k, repr(v)) for k, v in state.extra.items() if not isinstance(v, list)))
        expert_for = getattr(self.pipe, "expert_for", None)
        expert = expert_for(float(rows.timestep))[1] if expert_for is not None and not rows.done else 0
        return (tuple(rows.latents.shape[1:]), shared, expert)

    @torch.no_grad()
    def predict(self, batch: Sequence[StepRows]) -> list[torch.Tensor]:
        pipe = self.pipe
        if len(batch) == 1:  # the template's own step
            r = batch[0]
            state = r.state.state
            t = r.timestep.expand(state.batch)
            return [pipe.denoise_step(state, r.latents, t, [r.step] * state.batch)]
        xs, ts, texts, extras = [], [], [], []
        for r in batch:
            state = r.state.state
            t = r.timestep.expand(state.batch)
            x = pipe.model_input(state, r.latents, t)
            if state.options.cfg:
                x, t = torch.cat([x, x]), torch.cat([t, t])
            xs.append(x)
            ts.append(t)
            texts.append(state.text)
            extras.append(state.extra)
        first = batch[0].state.state
        extra = {
            k: [x for e in extras for x in e[k]] if isinstance(v, list) else v for k, v in first.extra.items()
        }
        merged = DenoiseState(
            first.options, sum(x.shape[0] for x in xs), merge_rows(texts), first.condition, extra
        )
        out = pipe.predict(merged, torch.cat(xs), torch.cat(ts))
        results, start = [], 0
        for r in batch:
            state = r.state.state
            mine = out[start : start + r.rows]
            start += r.rows
            t = r.timestep.expand(state.batch)
            pred = pipe.combine_cfg(state, mine, t) if state.options.cfg else mine
            results.append(pipe.to_velocity(pred))
        return results

    @torch.no_grad()
    def finish(
        self, prompts: Sequence[str], rows: Sequence[StepRows], output_type: str
    ) -> list[DiffusionOutput]:
        results = []
        for prompt, r in zip(prompts, rows, strict=True):
            state, sp = r.state.state, r.state.sp
            check_finite_latents(r.latents, r.num_steps)
            latents = self.pipe.finish_latents(r.latents, state)
            [result] = split_by_prompt([prompt], latents, state.options.n)
            if output_type != "latent":
                self.pipe.decode_into([result], latents, state, sp)
            results.append(result)
        return results


__all__ = ["TemplateSteps", "merge_rows"]
