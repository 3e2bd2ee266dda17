"""In-memory adapters (:class:`~vllm_omni.lora.tensor_request.TensorLoRARequest`) on LLM stages.

vLLM 0.32's ``LoRARequest`` carries no tensors: its worker (``vllm/lora/worker_manager.py``,
``WorkerLoRAManager._load_adapter``) reads ``adapter_config.json`` with ``PEFTHelper.from_local_dir``
and the weights with ``LoRAModel.from_local_checkpoint``, which itself ends in
``LoRAModel.from_lora_tensors``. An LLM stage's vLLM engine core runs in the stage's own process
(:func:`vllm_omni.engine.vllm_process.engine_core_in_stage_process`), so the stage keeps the adapters
handed over in memory in a process-local table (:func:`remember`, keyed by the request's
``lora_path``, which names the content: ``tensors://<name>#<hash>``, see
:meth:`~vllm_omni.lora.tensor_request.TensorLoRARequest.engine_form`) and :func:`install` wraps
``_load_adapter``: a request whose
``lora_path`` starts with ``tensors://`` is built with ``PEFTHelper.from_dict`` and
``LoRAModel.from_lora_tensors`` from copies of that table's tensors (vLLM scales what it is handed in
place), the same calls vLLM makes after reading files; any other request takes vLLM's own path. No file is written. vLLM may load an adapter again whenever its
own LRU cache evicted it, so an entry stays until every stage holding it removed it from its engine
(:func:`forget`) or was garbage-collected.

Adapter folders take the same path: the stage's validator reads a folder once into memory
(:class:`~vllm_omni.engine.lora_validation.AdapterContent`) and the stage remembers it in its in-memory form
(:func:`held_form`), so vLLM never maps an adapter file (safetensors tensors are mmap-backed and vLLM keeps
them without a copy: a folder rewritten in place would change a loaded version's weights, or kill the
process with ``SIGBUS``), and a version evicted and loaded again gets the bytes it was validated with.

The tensors reach the stage's process with the request: by reference (``inline``), through shared
memory (``mp``: torch's ``ForkingPickler``), or Ray's object store (``ray``).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.tensor_request import TENSOR_SCHEME, TensorLoRARequest

__all__ = ["forget", "held", "held_form", "install", "reachable", "remember"]

_lock = threading.Lock()
#: lora_path -> (the request, the stages holding it: ``id(stage)``)
_held: dict[str, tuple[TensorLoRARequest, set[int]]] = {}
#: (id(stage), lora_int_id) -> lora_path: what each stage holds under which of its ids
_owned: dict[tuple[int, int], str] = {}
_owners: set[int] = set()
_installed = False


def held(lora_path: str) -> TensorLoRARequest | None:
    """The in-memory adapter this process holds under ``lora_path``, or ``None``."""
    with _lock:
        entry = _held.get(lora_path)
    return None if entry is None else entry[0]


def reachable() -> bool:
    """Whether vLLM's loader runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING`` unset or false),
    where :func:`remember` ed content reaches it."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0").strip().lower() in ("0", "false")


def held_form(lora: Any, content: Any) -> TensorLoRARequest:
    """The in-memory form of a file adapter whose folder was read into ``content``
    (:class:`~vllm_omni.engine.lora_validation.AdapterContent`): vLLM is handed these bytes, never the
    files, so a version keeps its weights whatever happens to its folder (a trainer saving its next
    checkpoint over it, a truncation) and nothing is mapped from a file a user may rewrite. Its
    ``lora_path`` names the folder and the content (``tensors://<folder>#<first 16 hex of the hash>``).
    """
    return TensorLoRARequest(
        lora_name=lora.lora_name,
        lora_int_id=lora.lora_int_id,
        lora_path=f"{TENSOR_SCHEME}{lora.lora_path}#{content.sha256[:16]}",
        peft_config=content.config,
        lora_tensors=content.tensors,  # read into memory of their own by the validator; not copied again
        content_sha256=content.sha256,
    )


def remember(lora: Any, owner: object, stage_label: str) -> None:
    """Keep ``lora``'s tensors for vLLM's worker when it is a :class:`TensorLoRARequest` (else nothing).

    Raises:
        InvalidAdapterError: vLLM's engine core runs in a process of its own
            (``VLLM_ENABLE_V1_MULTIPROCESSING`` set to a true value), where this table is not seen.
    """
    if not isinstance(lora, TensorLoRARequest):
        return
    if not reachable():
        raise InvalidAdapterError(
            f"{lora.source}: {stage_label} runs vLLM's engine core in a process of its own "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=1), which in-memory adapters cannot reach; unset it "
            "(stages are processes already with worker_backend='mp' or 'ray')"
        )
    install()
    key = (id(owner), lora.lora_int_id)
    with _lock:
        entry = _held.get(lora.lora_path)
        if (entry is not None and entry[0].content_sha256 != lora.content_sha256) or _owned.get(
            key, lora.lora_path
        ) != lora.lora_path:
            raise InvalidAdapterError(
                f"{lora.source}: {lora.lora_path!r} / lora_int_id {lora.lora_int_id} holds other in-memory "
                f"weights on {stage_label}; give the new weights another id"
            )
        _held.setdefault(lora.lora_path, (lora, set()))[1].add(id(owner))
        _owned[key] = lora.lora_path
        if id(owner) not in _owners:
            _owners.add(id(owner))
            weakref.finalize(owner, _drop_owner, id(owner))


def forget(lora_int_id: int, owner: object) -> None:
    """``owner`` no longer holds ``lora_int_id`` in its engine; the tensors go when no stage does."""
    with _lock:
        _release(id(owner), lora_int_id)


def _release(owner: int, lora_int_id: int) -> None:
    path = _owned.pop((owner, lora_int_id), None)
    entry = None if path is None else _held.get(path)
    if path is not None and entry is not None:
        entry[1].discard(owner)
        if not entry[1]:
            del _held[path]


def _drop_owner(owner: int) -> None:
    """A stage was garbage-collected: what it held goes with it."""
    with _lock:
        for key in [k for k in _owned if k[0] == owner]:
            _release(*key)
        _owners.discard(owner)


def _load_from_tensors(manager: Any, lora_request: Any) -> Any:
    """``WorkerLoRAManager._load_adapter`` for an in-memory adapter (vLLM's steps, from the table)."""
    from vllm.lora.peft_helper import PEFTHelper

    lora = held(str(lora_request.lora_path))
    if lora is None:
        raise ValueError(
            f"in-memory adapter {lora_request.lora_name!r} (id {lora_request.lora_int_id}) is not held "
            "by this process any more; send its TensorLoRARequest again"
        )
    helper = PEFTHelper.from_dict(
        {**lora.peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings}
    )
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    # vLLM's own copies: its ``.to()`` returns a tensor of the right dtype and device as is, and the
    # adapter manager then folds ``lora_alpha / r`` into ``lora_B`` in place (``optimize``): handed the
    # held tensors, every load after an eviction would scale them once more (x4, x16, ... for r 8,
    # alpha 32), and under ``mp`` the caller's shared-memory copy with them.
    loaded = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id,
        tensors={key: tensor.clone() for key, tensor in lora.lora_tensors.items()},
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    loaded.is_3d_lora_weight = lora_request.is_3d_lora_weight
    manager._adapter_manager._validate_moe_lora_format(loaded)
    return loaded


def install() -> None:
    """Wrap vLLM's ``WorkerLoRAManager._load_adapter`` once per process (see the module docstring)."""
    global _installed
    with _lock:
        if _installed:
            return
        from vllm.lora.worker_manager import WorkerLoRAManager

        original = WorkerLoRAManager._load_adapter

        def _load_adapter(self, lora_request):
            if str(lora_request.lora_path).startswith(TENSOR_SCHEME):
                return _load_from_tensors(self, lora_request)
            return original(self, lora_request)

        WorkerLoRAManager._load_adapter = _load_adapter
        _installed = True
