"""Regional ``torch.compile`` of a diffusion denoiser (``enforce_eager=False``).

Only the repeated transformer blocks are compiled, one compiled function per block *class*: every
block of that class (in a list of many, a list of one or on its own) runs the same compiled code
(dynamo caches per code object and, with nn modules inlined, a block's parameters are graph inputs),
so the first compile costs one block per graph variant, not the whole network (the idea of diffusers' ``compile_repeated_blocks`` and of vLLM's
piecewise compilation). Embedders, the final layer, patchify / unpatchify and the ragged per-sample
Python of the model stay eager.

What makes a new graph (each compiled once per process, then found in the compile cache):

* a block class (Z-Image: the modulated ``noise_refiner`` / ``layers`` blocks and the unmodulated
  ``context_refiner`` blocks share one class but differ in a Python flag: two graphs);
* an optional input being ``None`` or a tensor (Z-Image's attention mask is ``None`` when every
  sample of the batch has the same caption length);
* a batch of one row versus more (dynamo specialises sizes 0 and 1); every dimension of the
  block inputs is marked dynamic (rows, sequence lengths, the attention mask's length; feature
  dimensions specialise to the weights' sizes), so image sizes and caption lengths never recompile;
* LoRA off (no adapter with a non-zero scale in the batch) versus on: the LoRA layers read
  fixed-shape banks (:mod:`vllm_omni.diffusion.lora.banks`), so adapters, scales, schedules and
  mixed batches never recompile.

Tensor inputs that are views enter a compiled block detached (a plain tensor on the same storage):
dynamo guards on a view's base, which would give the first block of a stack (fed a slice of an
embedder's output) graphs of its own. :mod:`vllm_omni.diffusion.compile_warmup` compiles every
variant before the first request (``compile_warm_up``).

A compiled call starts from a clean dispatch state (:func:`restore_dispatch_keys`): torch's
``no_dispatch()`` guard (``torch._C._DisableTorchDispatch``, which excludes the ``Python``,
``PreDispatch`` and ``PythonTLSSnapshot`` dispatch keys in the calling thread) has no stack of its
own; when one is entered in one thread and exited in another (a suspended generator or coroutine
that holds it, closed by the garbage collector wherever that runs, as torch's own
``in_kernel_invocation_manager`` can be), the thread that closes it keeps those keys excluded, and
every later ``torch.compile`` in it fails ("you set no_dispatch() before calling into this
function"). A serving process would keep that state for good; the compiler puts the keys back and
says so in the log.

Compiled artefacts are reused across restarts through inductor's FX graph cache in ``cache_dir``
(``TORCHINDUCTOR_CACHE_DIR`` is set to it around every compiled call); dynamo still traces each graph
again in a new process, which is the warm-restart cost.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

#: Graph variants one block class may accumulate before dynamo stops compiling it (dynamo's default, 8,
#: is below ``classes x mask x batch-of-one x LoRA`` on some models).
RECOMPILE_LIMIT = 64
_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

#: Inductor options of every compiled block. ``emulate_precision_casts`` rounds each bfloat16 /
#: float16 intermediate where eager rounds it; without it the rounding points follow inductor's
#: fusion, which differs between the LoRA-off and LoRA-on graphs, and a sample whose adapters all
#: have scale 0 then differs from the base output by a few bf16 ulps (measured on the toy DiT of
#: the tests). Cost: ~12 % of a bfloat16 compiled step (benchmark model); none in float32.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def default_cache_dir(key: str) -> str:
    """``$XDG_CACHE_HOME/vllm_omni/torch_compile/<key>`` (``~/.cache`` when ``XDG_CACHE_HOME`` is unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "vllm_omni", "torch_compile", key)


def stage_cache_key(*parts: object) -> str:
    """A short stable directory name for one stage's compile cache (model path, dtype, TP, ...)."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


def repeated_block_lists(module: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The ``nn.ModuleList`` children (recursively) whose entries, two or more, share one class.

    A module that declares ``_repeated_blocks`` (class names, diffusers' convention) restricts the
    search to lists of those classes.
    """
    wanted = set(getattr(module, "_repeated_blocks", None) or ())
    found = []
    for name, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or len(child) < 2:
            continue
        kinds = {type(block) for block in child}
        if len(kinds) == 1 and (not wanted or next(iter(kinds)).__name__ in wanted):
            found.append((name, child))
    return found


def repeated_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every submodule of a repeated block class, wherever it sits, outermost only.

    The classes are those of :func:`repeated_block_lists` plus the names in ``_repeated_blocks``;
    an instance in a list of one (Z-Image with one refiner layer) or outside any list is compiled
    too, as diffusers' ``compile_repeated_blocks`` compiles every instance of a listed class. A
    block nested inside another selected block runs inside that block's graph.
    """
    classes = {type(blocks[0]) for _, blocks in repeated_block_lists(module)}
    names = set(getattr(module, "_repeated_blocks", None) or ())
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        if child is module or not (type(child) in classes or type(child).__name__ in names):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, child))
    return found


@dataclass
class CompileStats:
    """What a :class:`RegionalCompiler` has compiled so far.

    Attributes:
        graphs: dynamo graphs created during compiled calls (new variants and recompiles).
        seconds: wall time of the calls that created them (compile time plus one block's run).
        variants: the input signatures seen (see the module doc).
        dispatch_repairs: compiled calls that found the dispatch keys of ``no_dispatch()`` excluded
            and included them again (:func:`restore_dispatch_keys`).
    """

    graphs: int = 0
    seconds: float = 0.0
    variants: set = field(default_factory=set)
    dispatch_repairs: int = 0


_PYTHON_KEY = torch._C.DispatchKey.Python


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


#: The dispatch keys ``torch._C._DisableTorchDispatch`` (``no_dispatch()``) excludes; no compiled call is
#: legitimately made with one of them excluded (dynamo refuses to make fake tensors then).
NO_DISPATCH_KEYS = ("Python", "PreDispatch", "PythonTLSSnapshot")


def excluded_dispatch_keys() -> list[str]:
    """The keys of :data:`NO_DISPATCH_KEYS` the calling thread's dispatch state excludes (empty: clean)."""
    return [
        k
        for k in NO_DISPATCH_KEYS
        if torch._C._dispatch_tls_is_dispatch_key_excluded(getattr(torch._C.DispatchKey, k))
    ]


def restore_dispatch_keys(label: str = "torch.compile") -> list[str]:
    """Include again the :data:`NO_DISPATCH_KEYS` the calling thread has excluded (see the module doc).

    Only for code that is never legitimately inside ``no_dispatch()``: the compiled calls of
    :class:`RegionalCompiler`. Logs a warning naming the keys, ``label`` and the thread.

    Returns:
        The keys that were excluded and are included again (empty when the state was clean).
    """
    keys = excluded_dispatch_keys()
    for key in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(getattr(torch._C.DispatchKey, key), False)
    if keys:
        logger.warning(
            "%s: torch's dispatch keys %s were left excluded in thread %r by earlier code (a no_dispatch() "
            "guard exited in another thread); included again so that compilation works",
            label,
            ", ".join(keys),
            threading.current_thread().name,
        )
    return keys


def _plain_one(value):
    # a view (``_base`` set) and a fresh tensor are different inputs to dynamo: after the first
    # recompile it guards on the view's base, so the first block of a stack (fed a view, e.g. an
    # embedder's reshaped output) and the later ones (fed a block's fresh output) would need a graph
    # each, for every variant. ``detach`` drops the view link and shares the storage (no copy).
    if isinstance(value, torch.Tensor) and value._base is not None:
        return value.detach()
    return value


def _plain(args: tuple) -> tuple:
    return tuple(_plain_one(v) for v in args)


def _tensors(args: tuple, kwargs: dict):
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]


class RegionalCompiler:
    """Compiles the repeated blocks of ``denoiser`` in place (each block's ``forward`` is replaced).

    Args:
        denoiser: the denoiser module.
        cache_dir: inductor cache directory (created); see :func:`default_cache_dir`.
        backend: ``torch.compile`` backend (``"inductor"``; tests use counting backends).
        before_call: called before every compiled block call (the LoRA step sync: a compiled region
            cannot run Python hooks).
        check_rows: called with the leading size of the first tensor input before every compiled call
            (raises for a batch the LoRA banks cannot hold).
        variant: extra signature of a call (e.g. whether LoRA is on), for the progress log only.
        label: the stage, in log lines.

    Raises:
        ValueError: the denoiser has no repeated block list.
    """

    def __init__(
        self,
        denoiser: nn.Module,
        *,
        cache_dir: str,
        backend: str | Callable = "inductor",
        before_call: Callable[[], None] | None = None,
        check_rows: Callable[[int], None] | None = None,
        variant: Callable[[], object] | None = None,
        label: str = "diffusion stage",
    ) -> None:
        found = repeated_blocks(denoiser)
        if not found:
            raise ValueError(f"{type(denoiser).__name__} has no repeated block list to compile")
        self.cache_dir = cache_dir
        os.makedirs(cache_dir, exist_ok=True)
        self.stats = CompileStats()
        self.before_call = before_call
        self.check_rows = check_rows
        self.variant = variant
        self.label = label
        #: qualified names of the compiled blocks
        self.block_names = [name for name, _ in found]
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        dynamo_config.accumulated_recompile_limit = max(
            dynamo_config.accumulated_recompile_limit, RECOMPILE_LIMIT * 4
        )
        compiled: dict[type, Callable] = {}
        self.blocks = 0
        for _, block in found:
            cls = type(block)
            if cls not in compiled:
                options = INDUCTOR_OPTIONS if backend == "inductor" else None
                compiled[cls] = torch.compile(cls.forward, backend=backend, options=options)
            block.forward = _CompiledBlock(self, block, compiled[cls])
            self.blocks += 1
        logger.info(
            "%s: torch.compile of %d repeated blocks (%s) in %s; each graph compiles on its first call",
            label,
            self.blocks,
            ", ".join(sorted({type(b).__name__ for _, b in found})),
            cache_dir,
        )

    def run(self, block: nn.Module, fn: Callable, args: tuple, kwargs: dict):
        """One compiled block call (see :class:`_CompiledBlock`)."""
        if torch._C._dispatch_tls_is_dispatch_key_excluded(_PYTHON_KEY):
            self.stats.dispatch_repairs += bool(restore_dispatch_keys(self.label))
        if os.environ.get(_CACHE_ENV) != self.cache_dir:
            os.environ[_CACHE_ENV] = self.cache_dir
        if self.before_call is not None:
            self.before_call()
        args, kwargs = _plain(args), {k: _plain_one(v) for k, v in kwargs.items()}
        tensors = _tensors(args, kwargs)
        if self.check_rows is not None and tensors:
            self.check_rows(int(tensors[0].shape[0]))
        # every dimension, the last included: a 2-D attention mask [rows, seq] has its sequence
        # length last, and a static one pins the whole block to that length (SDPA broadcasts the
        # mask against q/k). Feature dimensions meet the weights and specialise to constants,
        # which never change, so marking them costs nothing.
        for t in tensors:
            for dim in range(t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)
        signature = (
            type(block).__name__,
            tuple(
                None if v is None else (v.dim(), v.shape[0] == 1)
                for v in args
                if not isinstance(v, nn.Module)
            ),
            None if self.variant is None else self.variant(),
        )
        if signature not in self.stats.variants:
            return self._first_call(signature, block, fn, args, kwargs)
        before = _unique_graphs()
        out = fn(block, *args, **kwargs)
        new = _unique_graphs() - before
        if new:  # a variant the signature does not tell apart (dynamo's guards decide): say so
            self.stats.graphs += new
            logger.warning(
                "%s: %s compiled %d more graph(s) for %s", self.label, signature[0], new, signature
            )
        return out

    def _first_call(self, signature, block, fn, args, kwargs):
        self.stats.variants.add(signature)
        before, start = _unique_graphs(), time.perf_counter()
        logger.info("%s: compiling %s for inputs %s (variant %s) ...", self.label, *signature)
        show = sys.stderr.isatty()
        with tqdm(total=1, desc=f"torch.compile {signature[0]}", disable=not show, leave=False) as bar:
            out = fn(block, *args, **kwargs)
            bar.update(1)
        new, seconds = _unique_graphs() - before, time.perf_counter() - start
        self.stats.graphs += new
        self.stats.seconds += seconds
        logger.info("%s: %s ready in %.1f s (%d new graph(s))", self.label, signature[0], seconds, new)
        return out


class _CompiledBlock:
    """A block's ``forward`` replacement: the compiled class forward, called through its compiler."""

    def __init__(self, compiler: RegionalCompiler, block: nn.Module, fn: Callable) -> None:
        self.compiler = compiler
        self.block = block
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.compiler.run(self.block, self.fn, args, kwargs)


__all__ = [
    "INDUCTOR_OPTIONS",
    "NO_DISPATCH_KEYS",
    "RECOMPILE_LIMIT",
    "CompileStats",
    "RegionalCompiler",
    "default_cache_dir",
    "excluded_dispatch_keys",
    "repeated_block_lists",
    "repeated_blocks",
    "restore_dispatch_keys",
    "stage_cache_key",
]
