"""The per-step unit a pipeline offers to step-level batching (stage option ``batching="step"``).

A request that runs under step-level batching (:mod:`vllm_omni.diffusion.step_batching`) is one
:class:`StepRows`: its latents, its own scheduler (a fresh diffusers scheduler object: multistep
schedulers keep their history per request), its step index and whatever its pipeline needs at every
step (caption features, guidance). A pipeline's :class:`StepUnit` makes one from a request
(``prepare``: text encoding and initial noise, outside the denoiser loop), runs the denoiser once for
the rows of several requests whose latents share a shape (``predict``: one call, each row at its own
timestep, each request's CFG combined with its own guidance), and decodes a finished one (``finish``, several at once).

The unit's contract is that a request's rows give what the pipeline's own ``generate`` gives for that
request alone: same text encoding, same noise for the same seed, same scheduler steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.pipelines.base import LoRAContextFactory
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@dataclass
class StepRows:
    """One running request of a step-level batch.

    Attributes:
        latents: the request's latents, float32, ``num_images_per_prompt`` rows (the pipeline's layout).
        scheduler: the request's own scheduler, its timesteps set (``scheduler.timesteps``).
        rows: denoiser samples the request adds to a call (``num_images_per_prompt``, twice with CFG);
            they are contiguous in the call, positive samples first.
        state: the pipeline's own per-request data (caption features, guidance, ...).
        step: index of the next step (0-based, ``enumerate(scheduler.timesteps)``).
    """

    latents: torch.Tensor
    scheduler: Any
    rows: int
    state: Any = None
    step: int = 0

    @property
    def num_steps(self) -> int:
        return len(self.scheduler.timesteps)

    @property
    def timestep(self) -> torch.Tensor:
        """The scheduler's timestep of the next step (a 0-d tensor)."""
        return self.scheduler.timesteps[self.step]

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    def advance(self, output: torch.Tensor) -> None:
        """``latents = scheduler.step(output, t, latents)`` and move to the next step."""
        self.latents = self.scheduler.step(output, self.timestep, self.latents, return_dict=False)[0]
        self.step += 1


class StepUnit(Protocol):
    """What a pipeline implements to run under step-level batching (see the module docstring)."""

    def prepare(
        self,
        prompt: str,
        sp: OmniDiffusionSamplingParams,
        seed: int | None,
        lora_context: LoRAContextFactory | None,
    ) -> StepRows:
        """Check and encode one request, draw its noise, set its scheduler.

        Raises:
            InvalidRequestError: an argument the pipeline does not take (nothing is kept).
        """
        ...

    def key(self, rows: StepRows) -> tuple:
        """The batch key of ``rows`` at its next step (shape; the denoiser that step needs)."""
        ...

    def predict(self, batch: Sequence[StepRows]) -> list[torch.Tensor]:
        """One denoiser call over every request of ``batch`` (same :meth:`key`), each at its own step;
        per request the model output its scheduler steps with (CFG combined), float32."""
        ...

    def finish(
        self, prompts: Sequence[str], rows: Sequence[StepRows], output_type: str
    ) -> list[DiffusionOutput]:
        """Per request its :class:`DiffusionOutput` from its final latents (decoded unless ``"latent"``;
        requests that finished at the same step with the same shape, decoded together)."""
        ...


__all__ = ["StepRows", "StepUnit"]
