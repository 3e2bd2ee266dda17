"""Fixtures for the diffusion LoRA tests: a single-rank vLLM process group and saved PEFT adapters."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def diffusion_tp_group():
    """vLLM world / TP group of size 1 (gloo), needed to build vLLM linear layers.

    Per module, not per session: an in-process vLLM engine that another test module ran in the
    same pytest worker tears vLLM's groups down when it shuts down. Idempotent while they exist.
    """
    from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_parallel_state

    return init_diffusion_parallel_state(world_size=1, rank=0)


@pytest.fixture(scope="session")
def toy_base():
    """Base ``TorchToyDiT`` (plain nn.Linear layers) with random weights."""
    from lora_toy_models import make_torch_dit

    return make_torch_dit(seed=0)


@pytest.fixture(scope="session")
def adapters(toy_base, tmp_path_factory):
    """Saved PEFT adapters on ``toy_base``: name -> (directory, peft model).

    a: r4 all targets; b: r8 alpha 4 all targets; qv: r4 to_q/to_v only; rs: rsLoRA r4 alpha 6;
    pattern: r4 with rank_pattern/alpha_pattern; big: r16 (above max_rank 8).
    """
    from lora_toy_models import save_peft_adapter

    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "a": dict(seed=10),
        "b": dict(seed=11, r=8, lora_alpha=4.0),
        "qv": dict(seed=12, targets=["to_q", "to_v"]),
        "rs": dict(seed=13, lora_alpha=6.0, use_rslora=True),
        "pattern": dict(
            seed=14,
            rank_pattern={"to_q": 2, "ff.w2": 6},
            alpha_pattern={"to_v": 3.0, r"blocks\.1\.adaLN": 1.0},
        ),
        "big": dict(seed=15, r=16),
    }
    out = {}
    for name, spec in specs.items():
        path = str(root / name)
        out[name] = (path, save_peft_adapter(toy_base, path, **spec))
    return out
