"""The in-tree Wan pipeline at tensor-parallel size 2 (gloo, two spawned workers; one head per rank, q/k
RMS norms all-reduced across ranks) equals diffusers + peft, the reference TP=1 equals in
``test_wan_in_tree_pipeline`` (fp32, 1e-4), with the ``[high, low]`` pair and a mixed-adapter batch."""

from __future__ import annotations

import pytest

from tests.diffusion.test_wan_in_tree_pipeline import _err, _sp, files, loras, wan_moe_dir  # noqa: F401
from tests.diffusion.test_wan_moe_distill import PROMPT
from tests.diffusion.test_wan_moe_targets import _diffusers

pytestmark = [pytest.mark.slow]
TOL = 1e-4


def _shards(worker) -> tuple:
    """Runs in each rank: the shapes of this rank's packed q/k/v weight and q-norm weight."""
    attn = worker.pipeline.transformer_2.blocks[0].attn1
    return tuple(attn.to_qkv.weight.shape), tuple(attn.norm_q.weight.shape)


def test_tp2_equals_the_tp1_reference_with_the_pair_and_a_mixed_batch(wan_moe_dir, files, loras):  # noqa: F811
    from vllm_omni import Omni

    with Omni(str(wan_moe_dir), tensor_parallel_size=2, max_loras=3, dtype="float32") as omni:
        stage = omni._orchestrator.runtimes[0]
        assert stage.collective_rpc(_shards) == [((24, 16), (8,)), ((24, 16), (8,))]
        sets = [[loras["high"], loras["low"]], [loras["comfy"]], []]
        before = len(stage.batch_sizes)
        outs = omni.generate([PROMPT] * 3, _sp(), lora_requests=sets, use_tqdm=False)
        assert stage.batch_sizes[before:] == [3]
    assert _err(outs[0].latents, _diffusers(wan_moe_dir, [files["high"]], [files["low"]])) <= TOL
    assert _err(outs[1].latents, _diffusers(wan_moe_dir, [files["comfy"]], [])) <= TOL
    assert _err(outs[2].latents, _diffusers(wan_moe_dir, [], [])) <= TOL
