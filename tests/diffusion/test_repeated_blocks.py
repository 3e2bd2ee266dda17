"""Which blocks the regional compiler compiles: every instance of a repeated block class.

A class is "repeated" when some ``nn.ModuleList`` holds two or more of it (or the model names it in
``_repeated_blocks``, diffusers' convention); then its instances in a list of one, or outside any
list, are compiled as well (Z-Image with one refiner layer per refiner list), and a block nested in a
compiled block runs inside that block's graph.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn as nn

from vllm_omni.diffusion.compile import (
    NO_DISPATCH_KEYS,
    RegionalCompiler,
    excluded_dispatch_keys,
    repeated_blocks,
)


class Block(nn.Module):
    def __init__(self, dim: int = 4, inner: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.inner = Block(dim) if inner else None

    def forward(self, x):
        y = torch.tanh(self.proj(x))
        return self.inner(y) if self.inner is not None else y


class Other(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(x) * 2


class Toy(nn.Module):
    def __init__(self, named: tuple[str, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.refiner = nn.ModuleList([Block()])  # a list of one
        self.layers = nn.ModuleList([Block(), Block(inner=True)])
        self.final = Block()  # outside any list
        self.head = Other()
        if named:
            self._repeated_blocks = list(named)

    def forward(self, x):
        for block in (*self.refiner, *self.layers, self.final):
            x = block(x)
        return self.head(x)


class Counting:
    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def test_every_instance_of_a_repeated_class_is_found_outermost_only():
    names = [name for name, _ in repeated_blocks(Toy())]
    # layers.1.inner is a Block too, but it runs inside layers.1's graph
    assert names == ["refiner.0", "layers.0", "layers.1", "final"]
    # a class the model names is compiled even without a list of two
    assert [n for n, _ in repeated_blocks(Toy(named=("Block", "Other")))] == [
        "refiner.0",
        "layers.0",
        "layers.1",
        "final",
        "head",
    ]


def test_regional_compiler_runs_every_found_block_compiled_with_eager_numbers(tmp_path):
    torch._dynamo.reset()
    eager, compiled = Toy(), Toy()
    compiled.load_state_dict(eager.state_dict())
    backend = Counting()
    compiler = RegionalCompiler(compiled, cache_dir=str(tmp_path), backend=backend)
    assert compiler.blocks == 4
    assert compiler.block_names == ["refiner.0", "layers.0", "layers.1", "final"]
    calls = []
    original = compiler.run
    compiler.run = lambda block, fn, args, kwargs: calls.append(block) or original(block, fn, args, kwargs)
    x = torch.randn(3, 5, 4)
    with torch.no_grad():
        want, got = eager(x), compiled(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert calls == [compiled.refiner[0], compiled.layers[0], compiled.layers[1], compiled.final]
    # one compiled function for the class: the three plain blocks share one graph, the block with
    # an inner block (a branch dynamo guards on) gets the second; the unlisted head none
    assert backend.graphs == 2


def _close_here_a_no_dispatch_guard_entered_in_another_thread() -> None:
    """What a ``no_dispatch()`` guard held by a suspended generator leaves when the generator is
    entered in one thread and closed in this one (as the garbage collector closes it, in whatever
    thread it runs; torch's ``in_kernel_invocation_manager`` is such a generator): the keys stay
    excluded here."""

    def guarded():
        with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
            yield

    gen = guarded()
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        next(gen)
        entered.set()
        release.wait()

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait()
    gen.close()
    release.set()
    thread.join()


def test_a_compiled_call_after_a_no_dispatch_guard_left_in_this_thread_works(tmp_path, caplog):
    _close_here_a_no_dispatch_guard_entered_in_another_thread()
    assert excluded_dispatch_keys() == list(NO_DISPATCH_KEYS)
    x = torch.randn(3, 5, 4)
    # plain torch.compile fails in that state (what a serving process saw for every later compile)
    with pytest.raises(Exception, match="no_dispatch"):
        torch.compile(lambda t: torch.tanh(t) * 3, backend="eager")(x)
    eager, compiled = Toy(), Toy()
    compiled.load_state_dict(eager.state_dict())
    backend = Counting()
    compiler = RegionalCompiler(compiled, cache_dir=str(tmp_path), backend=backend, label="stage 7")
    with caplog.at_level(logging.WARNING, logger="vllm_omni.diffusion.compile"), torch.no_grad():
        got, want = compiled(x), eager(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert backend.graphs == 2 and compiler.stats.dispatch_repairs == 1
    assert excluded_dispatch_keys() == []  # the thread's state is clean again, for every later compile
    assert (
        "stage 7: torch's dispatch keys Python, PreDispatch, PythonTLSSnapshot were left excluded"
        in caplog.text
    )
