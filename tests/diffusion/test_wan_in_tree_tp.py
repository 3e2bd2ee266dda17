"""The in-tree Wan pipeline at tensor-parallel size 2 (gloo, two spawned workers; one head per rank, q/k
RMS norms all-reduced across ranks) equals diffusers + peft, the reference TP=1 equals in
``test_wan_in_tree_pipeline`` (fp32, 1e-4), with the ``[high, low]`` pair and a mixed-adapter batch, and a
lightx2v-style file at request time: its ``diff_b`` bias deltas on the row-parallel layers (``to_out.0``,
``ffn.net.2``) are added once (rank 0), not once per rank before the all-reduce."""

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


def test_tp2_equals_the_tp1_reference_with_the_pair_and_a_mixed_batch(wan_moe_dir, files, loras, tmp_path):  # noqa: F811
    from tools.make_tiny_wan import write_lightx2v_style_lora
    from vllm_omni import Omni
    from vllm_omni.lora.request import LoRARequest

    lightx2v = str(write_lightx2v_style_lora(wan_moe_dir, "transformer", 40, tmp_path / "lx2v.safetensors"))

    with Omni(str(wan_moe_dir), tensor_parallel_size=2, max_loras=3, dtype="float32") as omni:
        stage = omni._orchestrator.runtimes[0]
        assert stage.collective_rpc(_shards) == [((24, 16), (8,)), ((24, 16), (8,))]
        sets = [[loras["high"], loras["low"]], [loras["comfy"]], []]
        before = len(stage.batch_sizes)
        outs = omni.generate([PROMPT] * 3, _sp(), lora_requests=sets, use_tqdm=False)
        assert stage.batch_sizes[before:] == [3]
        request = LoRARequest("lightx2v", 9, lightx2v)
        [biased] = omni.generate([PROMPT], _sp(), lora_requests=[request], lora_scales=[0.7], use_tqdm=False)
    assert _err(biased.latents, _diffusers(wan_moe_dir, [lightx2v], [], weights=[0.7])) <= TOL
    assert _err(outs[0].latents, _diffusers(wan_moe_dir, [files["high"]], [files["low"]])) <= TOL
    assert _err(outs[1].latents, _diffusers(wan_moe_dir, [files["comfy"]], [])) <= TOL
    assert _err(outs[2].latents, _diffusers(wan_moe_dir, [], [])) <= TOL
