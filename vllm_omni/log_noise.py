"""Known log noise of a healthy ``vllm-omni serve`` run, demoted to DEBUG or said once.

A healthy start, request and stop on CPU printed warnings that look like faults and that the
user cannot act on (issue 39): vLLM's two contradicting Triton messages, one warning per weight
when a float32 checkpoint loads into bfloat16 parameters, vLLM's notes about our engine set-up
(the random seed of an in-process engine core, ``torch.set_num_threads`` after its thread
binding, the SSM cache dtype of models without SSM layers), deprecation notes caused by our
own calls into vLLM, and the model registry's "already registered. Overwriting" on a second
engine in one process. :func:`install` demotes those records to DEBUG (``VLLM_LOGGING_LEVEL=DEBUG``
shows them again) and turns the per-weight dtype warnings into one INFO line that says how to
keep float32. Warnings the user can act on (vLLM's ``LD_PRELOAD`` advice, for example) are left
as they are, but each kind (a logger's message template) is said once per process: its repeats with other
arguments (one per weight, per layer, per call) are DEBUG records.

It works through the log record factory (records are created demoted, so every handler, including
ones vLLM configures later, skips them), and ignores the ``FutureWarning`` vLLM's own import
raises about ``torch.distributed.reduce_op``. ``import vllm_omni`` installs it (:func:`install_if_asked`),
so a script that imports ``vllm_omni`` before vLLM (the examples: ``from vllm_omni import Omni``) and
every stage worker get it too; the ``serve`` command installs it before vLLM is imported and sets
:data:`ENV` for the processes it starts. :data:`KEEP_ENV` ``=1`` keeps every record as vLLM wrote it.

Only the standard library is imported here.
"""

from __future__ import annotations

import logging
import os
import warnings

#: Message starts (of the formatted message) demoted to DEBUG, with why nobody needs to act.
DEMOTED = {
    "Triton is installed, but doesn't include CPU backend": "CPU runs without Triton kernels; nothing to do",
    "Triton is not installed. triton-cpu is expected": "contradicts the line above (Triton without a CPU backend)",
    "Model Runner V2 requires Triton": "follows from the Triton lines: the V1 model runner is used",
    "The global random seed is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING": "the engine core runs in the "
    "stage worker by design (vllm_omni sets it)",
    "CPU backend doesn't allow to use `torch.set_num_threads`": "vLLM's own thread binding is kept",
    "Reset SSM cache type to float32": "models without SSM layers are unaffected",
    "Failed to create oneDNN linear": "torch's kernel is used for this shape",
    "vLLM has deprecated support for supporting different tokenizers for different LoRAs": "our call, not "
    "the user's; adapters use the base model's tokenizer",
    "Passing raw prompts to InputProcessor is deprecated": "our call into vLLM, not the user's",
}
#: ``... already registered. Overwriting`` (vLLM's model registry when a second engine registers ours).
_OVERWRITING = "already registered. Overwriting"
_DTYPE_LOAD = "Attempted to load weight"
_DTYPE_SUMMARY = (
    "Loading the checkpoint's float32 weights into bfloat16 parameters (dtype 'auto' on this CPU); "
    "pass --dtype float32 (dtype='float32' in Python) to keep float32"
)
#: Set by the ``serve`` command for the processes it starts: ``vllm_omni/__init__`` installs then.
#: (Not a ``VLLM_`` name: vLLM warns about those it does not know.)
ENV = "OMNI_DEMOTE_KNOWN_LOG_NOISE"
#: ``1``: leave vLLM's records as they are (no demotion) in processes that did not ask for it (``ENV``).
KEEP_ENV = "OMNI_KEEP_LOG_NOISE"
_REDUCE_OP = "`torch.distributed.reduce_op` is deprecated"

_installed = False
_said: set[str] = set()
#: ``(logger, message template)`` of the vLLM warnings said so far in this process (bounded)
_seen_kinds: set[tuple[str, str]] = set()
_MAX_KINDS = 4096


def _quieted(record: logging.LogRecord) -> logging.LogRecord:
    if record.levelno < logging.WARNING or record.name.partition(".")[0] != "vllm":
        return record
    try:
        text = record.getMessage()
    except Exception:  # a record whose args do not fit: leave it to the handler to report
        return record
    if _DTYPE_LOAD in text and "dtype torch.float32 into parameter with dtype torch.bfloat16" in text:
        if _DTYPE_SUMMARY not in _said:
            _said.add(_DTYPE_SUMMARY)
            record.msg, record.args = _DTYPE_SUMMARY, ()
            return _demote(record, logging.INFO)
        return _demote(record, logging.DEBUG)
    if text.startswith(tuple(DEMOTED)) or _OVERWRITING in text:
        return _demote(record, logging.DEBUG)
    if record.levelno != logging.WARNING:  # errors are never folded
        return record
    kind = (record.name, str(record.msg))  # one line per kind: a warning repeated per weight / per
    if kind in _seen_kinds:  # layer / per call with other arguments is said once, the rest is DEBUG
        return _demote(record, logging.DEBUG)
    if len(_seen_kinds) < _MAX_KINDS:
        _seen_kinds.add(kind)
    return record


def _demote(record: logging.LogRecord, level: int) -> logging.LogRecord:
    record.levelno, record.levelname = level, logging.getLevelName(level)
    return record


def install(children: bool = False) -> None:
    """Demote :data:`DEMOTED` in this process (idempotent); ``children``: also in the processes it
    starts from now on (:data:`ENV`)."""
    global _installed
    if children:
        os.environ[ENV] = "1"
    if _installed:
        return
    _installed = True
    warnings.filterwarnings("ignore", message=_REDUCE_OP, category=FutureWarning)
    inner = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        return _quieted(inner(*args, **kwargs))

    logging.setLogRecordFactory(factory)


def install_if_asked() -> None:
    """:func:`install` (``import vllm_omni`` calls this) unless :data:`KEEP_ENV` is ``1`` in a process
    the ``serve`` command did not start (:data:`ENV` set)."""
    if os.environ.get(ENV) == "1" or os.environ.get(KEEP_ENV) != "1":
        install()
