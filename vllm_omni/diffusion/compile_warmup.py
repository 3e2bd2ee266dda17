"""Warm-up of a compiled diffusion stage: every graph a request can need, compiled before the first one.

A compiled denoiser block has one graph per *variant* of its inputs (see :mod:`vllm_omni.diffusion.compile`):

* rows: a batch of one denoiser row (one prompt, no CFG, one image) or more (dynamo specialises size 1);
* caption padding: all texts of the batch as long as each other (no attention mask) or not (a mask);
* LoRA: no adapter active in the batch, or some (the compiled layers read the fixed-shape banks).

One row never has padding, so there are ``3 x 2`` variants (times the model's block kinds). The
warm-up runs one short generation per variant, with no adapter: the LoRA variants run with the banks
forced on and an all-zero scale table (their delta is exact zeros). Afterwards adapters, scales,
schedules, mixed adapter sets (CFG companions included), batch sizes up to the bank's rows, image
sizes and caption lengths reuse these graphs; ``tests/diffusion/test_compile_warmup.py`` counts it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from vllm_omni.inputs.data import OmniDiffusionSamplingParams

logger = logging.getLogger(__name__)

#: prompts of the warm-up: one alone (one row), the same twice (rows, no padding), two lengths (padding)
WARM_UP_BATCHES: tuple[tuple[str, ...], ...] = (
    ("a photo",),
    ("a photo", "a photo"),
    ("a photo", "a photo of a lighthouse on a cliff at night, oil painting"),
)


@contextlib.contextmanager
def forced_banks(worker: Any) -> Iterator[None]:
    """Compiled regions of ``worker``'s denoisers take the LoRA bank path with every scale zero.

    Writes zeros into each bank scale table (group 0 for every layer) and sets ``force_bank`` on the
    managers' batch states; restores both (state cleared, ``force_bank`` off) on exit.
    """
    states = []
    for manager in worker.lora.managers.values():
        if manager.banks is None or not manager.wrappers:
            continue
        manager.banks.publish(torch.zeros(1, manager.banks.max_loras), [])
        state = next(iter(manager.wrappers.values())).lora_state
        state.force_bank = True
        state.clear()
        states.append(state)
    try:
        yield
    finally:
        for state in states:
            state.force_bank = False
            state.clear()


def warm_up_compiled(worker: Any, *, height: int = 64, width: int = 64, steps: int = 1) -> int:
    """Compile every graph variant of ``worker``'s compiled denoisers (see the module doc).

    Args:
        worker: a :class:`~vllm_omni.diffusion.worker.DiffusionWorker` (any rank; every rank of a
            tensor-parallel stage must call it, as for a request).
        height, width: image size in pixels of the warm-up runs (a size the model accepts with more
            than one latent patch per side; the graphs do not depend on it). Pipelines that take an
            input image (edit, image-to-video) get a grey one of that size; on a Wan2.2 TI2V-5B stage,
            whose image is optional, requests without one run the same (per-token timestep) graphs.
        steps: denoising steps per run.

    Returns:
        The number of graphs the warm-up created (``0`` for an eager stage, which it leaves alone).

    Raises:
        whatever a request of that size raises (e.g. a size the VAE cannot take).
    """
    if not worker.compilers:
        return 0
    before = sum(c.stats.graphs for c in worker.compilers)
    extra = {}
    if getattr(worker.pipeline, "accepts_image", False):  # edit / image-to-video: a grey input image
        from PIL import Image

        extra["image"] = Image.new("RGB", (width, height), (128, 128, 128))
    sp = OmniDiffusionSamplingParams(
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=0.0,
        seed=0,
        output_type="latent",
        extra_args=extra,
    )
    for lora in (False, True):
        with forced_banks(worker) if lora else contextlib.nullcontext():
            for prompts in WARM_UP_BATCHES:
                for result in worker.generate_batch(list(prompts), sp) or ():
                    if isinstance(result, BaseException):
                        raise result
    graphs = sum(c.stats.graphs for c in worker.compilers) - before
    logger.info("compiled diffusion stage warmed up: %d graph(s)", graphs)
    return graphs


__all__ = ["WARM_UP_BATCHES", "forced_banks", "warm_up_compiled"]
