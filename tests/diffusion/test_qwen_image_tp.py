"""The in-tree Qwen-Image pipeline at tensor-parallel size 2 (gloo, two spawned workers; one of the tiny
model's two heads per rank) equals the TP=1 engine, which ``test_qwen_image_pipeline`` checks against
diffusers + peft (fp32, 1e-4). One TP=2 engine, one mixed batch with true CFG (a negative prompt) on
every row: no adapter (two prompts of different lengths), a PEFT folder, a kohya (musubi) file, and the
PEFT folder composed with the kohya file at different scales."""

from __future__ import annotations

import pytest

from tests.diffusion.test_qwen_image_pipeline import PROMPT, params
from vllm_omni.lora.request import LoRARequest

pytestmark = [pytest.mark.slow]
TOL = 1e-4


def _shards(worker) -> tuple:
    """Runs in each rank: the shapes of this rank's packed image q/k/v weight and first MLP weight."""
    block = worker.pipeline.transformer.transformer_blocks[0]
    return tuple(block.attn.to_qkv.weight.shape), tuple(block.img_mlp.net[0].proj.weight.shape)


def _batch(loras) -> tuple[list[str], list[list[LoRARequest]], list[list[float]]]:
    """The rows: base (two prompts), PEFT, kohya file, PEFT + kohya composed (each at its own scale)."""
    peft = LoRARequest("mlp", 1, str(loras["mlp"]))
    kohya = LoRARequest("kohya", 2, str(loras["attn_kohya"]))
    prompts = [PROMPT, "a blue dog", PROMPT, PROMPT, PROMPT]
    sets = [[], [], [peft], [kohya], [peft, kohya]]
    scales = [[], [], [1.2], [0.8], [0.6, 1.4]]
    return prompts, sets, scales


def _run(omni, loras) -> list:
    prompts, sets, scales = _batch(loras)
    stage = omni._orchestrator.runtimes[0]
    before = len(stage.batch_sizes)
    outs = omni.generate(prompts, params(), lora_requests=sets, lora_scales=scales, use_tqdm=False)
    assert stage.batch_sizes[before:] == [5], "the five requests must share one denoiser batch"
    return [out.latents for out in outs]


def test_tp2_equals_tp1_on_a_mixed_adapter_batch_with_cfg(tiny_qwen_image_dir, tiny_qwen_image_loras):
    from vllm_omni import Omni

    kwargs = dict(dtype="float32", enable_progress_bar=False, max_loras=2)
    with Omni(str(tiny_qwen_image_dir), tensor_parallel_size=2, **kwargs) as omni:
        # 2 heads x 32 channels: one head's q/k/v (3 x 32 rows) and half the 4 x 64 MLP rows per rank
        assert omni._orchestrator.runtimes[0].collective_rpc(_shards) == [((96, 64), (128, 64))] * 2
        tp2 = _run(omni, tiny_qwen_image_loras)
    with Omni(str(tiny_qwen_image_dir), **kwargs) as omni:
        tp1 = _run(omni, tiny_qwen_image_loras)
    for row, (a, b) in enumerate(zip(tp1, tp2, strict=True)):
        assert a.shape == b.shape == (1, 6, 64)
        assert (a - b).abs().max().item() <= TOL, row
    for row in (2, 3, 4):  # each adapter row differs from base (and the composed row from its parts)
        assert (tp1[row] - tp1[0]).abs().max().item() > 50 * TOL, row
    assert min((tp1[4] - tp1[r]).abs().max().item() for r in (2, 3)) > 50 * TOL
