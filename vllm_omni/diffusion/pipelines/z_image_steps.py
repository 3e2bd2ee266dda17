"""Z-Image's per-step unit for step-level batching (:mod:`vllm_omni.diffusion.pipelines.step_unit`).

Each request is prepared as ``ZImagePipeline.generate`` prepares one prompt (chat-templated caption
features, the prompt's seeded noise, resolution-shifted sigmas on a fresh scheduler); a denoiser call
takes the samples of several requests, each request's ``n`` positive samples followed, with CFG, by
its ``n`` negative ones, each sample at its request's own timestep ``(1000 - t) / 1000``; each request
then combines its branches with its own guidance (``pos + g * (pos - neg)``) and negates the result
for its Euler step, as the pipeline does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.diffusion.pipelines.denoise import (
    attach_decoded,
    encode_texts,
    prepare_scheduler,
    resolution_shift_mu,
    seeded_noise,
    split_by_prompt,
)
from vllm_omni.diffusion.pipelines.step_unit import StepRows
from vllm_omni.errors import InvalidRequestError

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.pipelines.base import LoRAContextFactory
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

#: the pipeline's guidance when a request sets none (``ZImagePipeline``'s default)
DEFAULT_GUIDANCE = 5.0


@dataclass
class _ZImageState:
    captions: list[torch.Tensor]  # n positive then (CFG) n negative caption features
    guidance: float
    n: int


class ZImageSteps:
    """The step unit of a loaded :class:`~vllm_omni.diffusion.models.z_image.pipeline.ZImagePipeline`."""

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
        if sp.extra_args:  # never ignore an argument silently (as ZImagePipeline.generate)
            raise InvalidRequestError(
                f"extra_args {sorted(sp.extra_args)} are not used by the in-tree Z-Image pipeline; "
                "run the stage with pipeline_backend='diffusers' to pass pipeline-specific arguments"
            )
        height, width = pipe.resolve_size(sp)
        guidance = DEFAULT_GUIDANCE if sp.guidance_scale is None else float(sp.guidance_scale)
        cfg = guidance > 0
        n = sp.num_images_per_prompt
        encoded = encode_texts(
            lambda texts: pipe.encode_captions(texts, sp.max_sequence_length),
            [prompt],
            sp.negative_prompt,
            cfg,
            lora_context,
        )
        captions = [c for c in encoded for _ in range(n)]
        factor = pipe.vae_scale_factor * 2
        shape = (pipe.transformer.in_channels, 2 * (height // factor), 2 * (width // factor))
        latents = seeded_noise(shape, n, sp, 1, [seed], pipe.device)
        steps = sp.num_inference_steps
        mu = resolution_shift_mu((shape[1] // 2) * (shape[2] // 2), pipe.scheduler.config)
        sigmas = torch.linspace(1.0, 1.0 / steps, steps).tolist()
        scheduler = prepare_scheduler(pipe.scheduler, pipe.device, sigmas=sigmas, mu=mu)
        return StepRows(
            latents, scheduler, rows=n * (2 if cfg else 1), state=_ZImageState(captions, guidance, n)
        )

    def key(self, rows: StepRows) -> tuple:
        return tuple(rows.latents.shape[1:])

    @torch.no_grad()
    def predict(self, batch: Sequence[StepRows]) -> list[torch.Tensor]:
        transformer = self.pipe.transformer
        xs, ts, captions = [], [], []
        for r in batch:
            s: _ZImageState = r.state
            t = (1000 - r.timestep.expand(s.n)) / 1000
            x = r.latents.to(transformer.dtype)
            if s.guidance > 0:
                x, t = x.repeat(2, 1, 1, 1), t.repeat(2)
            xs.append(x)
            ts.append(t)
            captions.extend(s.captions)
        x = torch.cat(xs)
        out = transformer(list(x.unsqueeze(2).unbind(0)), torch.cat(ts), captions)
        out = torch.stack([o.float() for o in out]).squeeze(2)
        results, start = [], 0
        for r in batch:
            s = r.state
            mine = out[start : start + r.rows]
            start += r.rows
            pred = mine[: s.n] + s.guidance * (mine[: s.n] - mine[s.n :]) if s.guidance > 0 else mine
            results.append(-pred)
        return results

    @torch.no_grad()
    def finish(
        self, prompts: Sequence[str], rows: Sequence[StepRows], output_type: str
    ) -> list[DiffusionOutput]:
        results = []
        for prompt, r in zip(prompts, rows, strict=True):
            results += split_by_prompt([prompt], r.latents, r.state.n)
        if output_type != "latent":  # one VAE call for the requests that finished together
            latents = torch.cat([r.latents for r in rows])
            decoded = self.pipe.decode(latents, output_type)
            start = 0
            for result, r in zip(results, rows, strict=True):
                attach_decoded([result], decoded[start : start + r.state.n], output_type, r.state.n)
                start += r.state.n
        return results


__all__ = ["ZImageSteps"]
