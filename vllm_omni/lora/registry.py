"""The adapter registry: the one owner of what an adapter is, where it acts and what state it has.

``Omni`` / ``AsyncOmni`` own one :class:`AdapterRegistry`; every way an adapter enters goes through it:
``add_lora`` / ``remove_lora`` / ``pin_lora`` / ``list_loras``, the adapters of a request (by name or by
path), the server's ``--lora-modules`` / ``--lora-path`` and ``/v1/load_lora_adapter``. Stages keep their own
caches (vLLM's LoRA and prefix caches, the diffusion host cache and slots); the registry decides what they
are handed, so those caches can never mix two versions of an adapter.

Identity and versions
    An adapter is a public ``(name, int_id)`` pair (what the caller gave: ``LoRARequest(name, id, path)``)
    bound to its resolved files and a **content fingerprint**: the SHA-256 of ``adapter_config.json`` (when
    present) and the weights file, in that order (:func:`fingerprint_files`). The fingerprint is the
    adapter's version. Stages are handed a per-version identity, :attr:`AdapterRecord.engine`: the public
    name with an engine id, the public id for the first version issued under it and a fresh id for any
    other content (vLLM and the diffusion host cache key adapters by id). An engine id is never reused
    for other content while the registry lives. An LLM stage hands vLLM the name ``"<name>@<engine id>"``
    (:func:`vllm_omni.engine.vllm_adapter_names.vllm_lora_request`: vLLM keys its prefix cache by lora name and
    path, and compares ``LoRARequest`` s by name), so versions never share KV blocks either. Registering
    a name again with the same files and content is a no-op; other content (new files at the same path,
    another path, ``reload=True`` after a rewrite) is a new version: it is loaded on the stages first,
    then the old version is dropped from them. A request naming an adapter whose files changed on disk
    since they were fingerprinted gets the new version (files are re-read only when their
    ``(inode, size, mtime)`` changed).

Targets
    A registered adapter acts on the stages it targets: ``stage_id`` (one id or a list), by default the
    entry stage only, since an adapter fits one model. ``denoiser`` names the denoiser of a two-denoiser
    diffusion stage when given (checked against the target stages' denoisers, reported, and used by
    :meth:`AdapterRegistry.resolve_adapter` for a request adapter that names none).

Registration is all-or-nothing and linearizable
    Calls on one name are serialised (one lock per name); a load is first made on every target stage
    (a replicated stage is itself all-or-nothing over its replicas) and a refusal by one rolls back the
    others, so a refused load leaves nothing behind. The registry's tables change only after every stage
    accepted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from vllm_omni.errors import (
    AdapterFileNotAllowedError,
    AdapterNotFoundError,
    AdapterUpdateRefusedError,
    InvalidAdapterError,
    InvalidRequestError,
    LoRACacheError,
)
from vllm_omni.lora.adapter_files import AdapterFiles, file_signature, fingerprint_files, locate_adapter
from vllm_omni.lora.allow_list import refuse_unreadable
from vllm_omni.lora.records import (
    AdapterRecord,
    StageState,
    checked_lora_request,
    denoiser_error,
    derived_engine_id,
    describe_adapter,
    resolved_location,
)
from vllm_omni.lora.request import LoRARequest, RequestAdapter, canonical_denoiser
from vllm_omni.lora.restarts import RestartLosses, expected_on, failed_on_stages
from vllm_omni.lora.stage_fanout import StageCall, StageFanOut
from vllm_omni.lora.tensor_request import TensorLoRARequest, tensor_identity

__all__ = ["AdapterRecord", "AdapterRegistry", "StageCall", "StageState"]

logger = logging.getLogger(__name__)


class AdapterRegistry:
    """Every adapter of one engine client and its state on the stages (thread-safe).

    Args:
        call: runs a LoRA method on the stages (:data:`StageCall`).
        entry_stage_id: the default target.
        stage_labels: ``{stage_id: label}`` for messages.
        check: ``check(stage_id, engine_request)`` raises what a stage would refuse, loading nothing
            (run on every target before any loads, so that a refusal does not even evict another
            adapter from a cache); ``None``: refusals are only rolled back.
    """

    def __init__(
        self,
        call: StageCall,
        entry_stage_id: int = 0,
        stage_labels: Mapping[int, str] | None = None,
        check: Callable[[int, LoRARequest], None] | None = None,
        denoisers: Callable[[int], Sequence[str] | None] | None = None,
    ):
        self._call = call
        #: add / pin / roll back / drop one version on its target stages
        self._stages = StageFanOut(call, check, stage_labels)
        self._denoisers = denoisers  # stage id -> the denoisers adapters bind to there (diffusion stages)
        self.entry_stage_id = entry_stage_id
        self._lock = threading.RLock()  # the tables below; never held across a stage call
        self._name_locks: dict[str, threading.Lock] = {}
        self._by_id: dict[int, AdapterRecord] = {}
        self._names: dict[str, int] = {}  # registered names -> int_id, in registration order
        self._claims: dict[int, str] = {}  # ids being registered -> name
        self._engine_owner: dict[int, tuple[str, str]] = {}  # engine id -> (location, fingerprint)
        self._engine_public: dict[int, int] = {}  # engine id -> public id
        self._reserved: dict[str, str] = {}
        self._fingerprints: dict[tuple, str] = {}
        self._lost = RestartLosses()  # what restarts could not restore (see :meth:`note_restart`)
        self._file_check: Callable[[str, AdapterFiles, str], None] | None = None
        self._refused: dict[int, tuple] = {}  # public id -> file signature of a version refused for room

    # ------------------------------------------------------------------ lookups
    def get(self, name: str) -> AdapterRecord | None:
        """The registered adapter called ``name``, or ``None``."""
        with self._lock:
            int_id = self._names.get(name)
            return None if int_id is None else self._by_id.get(int_id)

    def by_id(self, int_id: int) -> AdapterRecord | None:
        """The adapter (registered or seen in a request) with public id ``int_id``, or ``None``."""
        with self._lock:
            return self._by_id.get(int_id)

    def records(self) -> list[AdapterRecord]:
        """The registered adapters, in registration order."""
        with self._lock:
            return [self._by_id[i] for i in self._names.values()]

    def public_id(self, engine_id: int) -> int:
        """The public id of a stage's adapter id (``engine_id`` itself when unknown)."""
        with self._lock:
            return self._engine_public.get(engine_id, engine_id)

    def reserve_names(self, names: Sequence[str], why: str) -> None:
        """Refuse these names for adapters (e.g. the served model's names), saying ``why``."""
        with self._lock:
            self._reserved.update(dict.fromkeys(names, why))

    def set_file_check(self, check: Callable[[str, AdapterFiles, str], None] | None) -> None:
        """Run ``check(location, files, shown)`` right before every read of an adapter's files
        (registration, reload, a request finding them changed, a worker restart); it raises
        :class:`~vllm_omni.errors.AdapterFileNotAllowedError` to refuse the read (the
        server's ``--lora-dirs``: :class:`~vllm_omni.lora.allow_list.AdapterFileAllowList`)."""
        self._file_check = check

    def expected_on(self, stage_id: int) -> list[tuple[LoRARequest, bool]]:
        """``(engine request, pinned)`` of every registered adapter targeting ``stage_id`` (what a
        restarted worker of that stage must hold), in registration order. An adapter whose files the
        file check now refuses comes as a :class:`~vllm_omni.lora.allow_list.RefusedRestore` (not
        loaded; the restart reports it as not restored, naming the file)."""
        return [
            (refuse_unreadable(r, self._file_check, stage_id), p)
            for r, p in expected_on(self.records(), stage_id)
        ]

    def note_restart(self, stage_id: int, failed: Mapping[int, str], replica: int = 0) -> None:
        """A worker of ``stage_id`` (replica ``replica``) restarted; ``failed`` maps the engine ids it
        could not restore to the error. Those adapters become ``failed`` on the stage (requests
        naming them are refused by the stage until they are added again); the others it restored
        are ``loaded`` / ``pinned`` again."""
        with self._lock:
            self._lost.note(
                stage_id, replica, {self._engine_public.get(e, e): msg for e, msg in failed.items()}
            )
            for int_id, record in list(self._by_id.items()):
                if stage_id in record.targets:
                    state = self._lost.state_on(record, stage_id)
                    self._by_id[int_id] = replace(record, stages={**record.stages, stage_id: state})

    def failed(self) -> dict[int, dict[int, str]]:
        """``{stage_id: {int_id: error}}`` of the registered adapters a worker restart could not restore."""
        return failed_on_stages(self.records())

    # ------------------------------------------------------------------ identity
    @contextmanager
    def _name_lock(self, name: str) -> Iterator[None]:
        with self._lock:
            lock = self._name_locks.setdefault(name, threading.Lock())
        with lock:
            yield

    def _identity(self, lora: LoRARequest, fresh: bool = False) -> tuple[str, AdapterFiles, str, tuple]:
        """``(location, files, fingerprint, signature)`` of ``lora``'s files (hashed once per signature).

        Raises:
            AdapterNotFoundError (an ``InvalidAdapterError`` and a ``FileNotFoundError``) / InvalidAdapterError:
                the files cannot be found or read (naming the adapter).
        """
        if isinstance(lora, TensorLoRARequest):  # in memory: its copied tensors' hash is the version
            return tensor_identity(lora)
        location = resolved_location(str(lora.lora_path))
        try:
            files = locate_adapter(location, shown=describe_adapter(lora))
            if self._file_check is not None:  # at every read, not only the first
                self._file_check(location, files, str(lora.lora_path))
            signature = file_signature(files)
        except FileNotFoundError:
            raise AdapterNotFoundError(f"{describe_adapter(lora)}: no such adapter file or folder") from None
        except OSError as exc:
            raise InvalidAdapterError(f"{describe_adapter(lora)}: cannot read its files: {exc}") from exc
        digest = None if fresh else self._fingerprints.get(signature)
        if digest is None:
            try:
                digest = fingerprint_files(files)
            except OSError as exc:
                raise InvalidAdapterError(f"{describe_adapter(lora)}: cannot read its files: {exc}") from exc
            with self._lock:
                self._fingerprints[signature] = digest
        return location, files, digest, signature

    def _engine_request(self, name: str, int_id: int, location: str, digest: str) -> LoRARequest:
        """The per-version ``LoRARequest`` stages get; its id is ``int_id`` unless that id was issued for
        other content, then a fresh one (never one issued for other content)."""
        key = (location, digest)
        with self._lock:
            engine_id = int_id
            while self._engine_owner.get(engine_id, key) != key:
                engine_id = derived_engine_id(engine_id, key)
            self._engine_owner[engine_id] = key
            self._engine_public[engine_id] = int_id
        return LoRARequest(name, engine_id, location)

    def _id_conflict(self, lora: LoRARequest, location: str, allowed: AdapterRecord | None) -> str | None:
        """Why ``lora``'s id cannot be used (``None``: it can); call with the table lock held."""
        int_id = lora.lora_int_id
        claim = self._claims.get(int_id)
        if claim is not None and claim != lora.lora_name:
            return f"lora_int_id {int_id} is being registered for adapter {claim!r}"
        held = self._by_id.get(int_id)
        if held is None or held is allowed:
            return None
        if held.registered and held.name != lora.lora_name:
            return f"lora_int_id {int_id} already names adapter {held.name!r} ({held.location!r})"
        if held.location != location:
            return f"lora_int_id {int_id} already names adapter {held.location!r}"
        return None

    # ------------------------------------------------------------------ requests
    def resolve(self, lora: Any) -> Any:
        """The per-version form of one request adapter (anything that is not a usable ``LoRARequest`` is
        returned unchanged for the stage to refuse; so is one whose files cannot be found).

        Raises:
            InvalidAdapterError: its id already names an adapter at another location (remove it first),
                or its files changed on disk and the new version is refused by a stage.
            AdapterFileNotAllowedError: its files would be read (new, or changed on disk) but the file
                check refuses them (they now resolve outside the server's ``--lora-dirs``); the loaded
                version stays registered and serves again once the files are back.
        """
        if not isinstance(lora, LoRARequest) or not lora.lora_path or isinstance(lora.lora_int_id, bool):
            return lora
        if isinstance(lora, TensorLoRARequest):
            return self._resolve_tensors(lora)
        location = resolved_location(str(lora.lora_path))
        record = self._by_id.get(lora.lora_int_id)
        if record is not None and record.location == location:
            try:
                signature = file_signature(record.files)
            except OSError:  # files gone: the loaded version still serves (a stage may refuse a reload)
                return record.engine
            if signature in (record.signature, self._refused.get(record.int_id)):
                return record.engine  # unchanged, or a version refused for room: the loaded one serves
            return self._refresh(record, signature)
        try:
            identity = self._identity(lora)
        except AdapterFileNotAllowedError:
            raise  # the stage would read the same files
        except (FileNotFoundError, InvalidAdapterError):
            return lora
        with self._lock:
            why = self._id_conflict(lora, location, None)
            if why is not None:
                raise InvalidAdapterError(
                    f"{describe_adapter(lora)}: {why}; give this adapter another id, or remove_lora({lora.lora_int_id}) first"
                )
            record = self._by_id.get(lora.lora_int_id)
            if record is None:
                record = self._new_record(lora, identity, registered=False, source="request")
                self._by_id[lora.lora_int_id] = record
        return record.engine

    def _refresh(self, record: AdapterRecord, signature: tuple) -> LoRARequest:
        """A new version of ``record`` after its files changed on disk (to ``signature``); the loaded
        version when a stage has no room for it (logged once per signature; a reload, or the first
        request after a ``remove``, tries again)."""
        if record.registered:
            try:
                self.add(record.request, record.targets or None, denoiser=record.denoiser, reload=True)
            except AdapterUpdateRefusedError as exc:
                with self._lock:
                    self._refused[record.int_id] = signature
                logger.warning("%s; requests get the loaded version until the adapter is reloaded", exc)
                return record.engine
            return self._by_id[record.int_id].engine
        identity = self._identity(record.request, fresh=True)
        with self._lock:
            current = self._by_id.get(record.int_id)
            if current is not None and current.fingerprint == identity[2]:
                return current.engine
            new = self._new_record(record.request, identity, registered=False, source="request")
            self._by_id[record.int_id] = replace(new, version=record.version + 1)
        return new.engine

    def _resolve_tensors(self, lora: TensorLoRARequest) -> LoRARequest:
        """:meth:`resolve` of an in-memory adapter: the version its tensors are (same id and name with
        other tensors is a new version; a registered one is registered again, the old one dropped)."""
        record = self._by_id.get(lora.lora_int_id)
        if record is not None and record.location != lora.lora_path:
            record = None  # another adapter's id: refused below
        elif record is not None and record.fingerprint == lora.content_sha256:
            return record.engine
        elif record is not None and record.registered:
            self.add(lora, record.targets or None, denoiser=record.denoiser)
            return self._by_id[record.int_id].engine
        with self._lock:
            why = self._id_conflict(lora, lora.lora_path, record)
            if why is not None:
                raise InvalidAdapterError(f"{describe_adapter(lora)}: {why}; give this adapter another id")
            new = self._new_record(lora, tensor_identity(lora), registered=False, source="request")
            if record is not None:
                new = replace(new, version=record.version + 1)
            self._by_id[lora.lora_int_id] = new
        if record is not None and record.engine.lora_int_id != new.engine.lora_int_id:
            try:  # the stages drop the old version's tensors (best effort: a running batch may hold it)
                self._stages.unload(record.engine, record.targets)
            except Exception as exc:
                logger.info("old version of %s stays until evicted: %s", describe_adapter(lora), exc)
        return new.engine

    def _new_record(self, lora: LoRARequest, identity: tuple, **fields: Any) -> AdapterRecord:
        location, files, digest, signature = identity
        engine = self._engine_request(lora.lora_name, lora.lora_int_id, location, digest)
        if isinstance(lora, TensorLoRARequest):  # the stages get the tensors, under the version's id
            engine = lora.engine_form(engine.lora_name, engine.lora_int_id)
        return AdapterRecord(
            lora.lora_name, lora.lora_int_id, location, files, digest, engine, signature=signature, **fields
        )

    # ------------------------------------------------------------------ registration
    def _targets(self, stage_id: int | Sequence[int] | None, old: AdapterRecord | None) -> tuple[int, ...]:
        if stage_id is None:
            return old.targets if old is not None and old.targets else (self.entry_stage_id,)
        if isinstance(stage_id, int) and not isinstance(stage_id, bool):
            return (stage_id,)
        ids = tuple(dict.fromkeys(stage_id))  # type: ignore[arg-type]  # a bool is refused just below
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise InvalidAdapterError(
                f"stage_id must be a stage id or a non-empty list of them, got {stage_id!r}"
            )
        return ids

    def add(
        self,
        lora: LoRARequest,
        stage_id: int | Sequence[int] | None = None,
        *,
        denoiser: str | None = None,
        reload: bool = False,
        replace: bool = True,
    ) -> bool:
        """Register ``lora`` on its target stages (all-or-nothing); see the module docstring.

        Args:
            lora: ``LoRARequest(name, int_id, path)``.
            stage_id: target stage(s); ``None``: where the name is registered already, else the entry stage.
            denoiser: the denoiser of a two-denoiser stage it targets.
            reload: re-read the files even when their ``(inode, size, mtime)`` did not change.
            replace: ``False`` refuses a name that is registered already (checked under the name's lock,
                so of concurrent calls exactly one registers it).

        Returns:
            ``True`` when something changed (a new adapter, version or target), ``False`` for the same
            name, id, files and content already registered there (a no-op).

        Raises:
            InvalidAdapterError: a reserved name, a registered name with ``replace=False``, an id that
                names another adapter, files a stage refuses
                (message prefixed with the adapter and the stage; nothing stays loaded anywhere).
            AdapterNotFoundError: no such file or folder (also a ``FileNotFoundError``).
            AdapterUpdateRefusedError / LoRACacheError: a new version / adapter finds no room in a stage's
                cache (every entry pinned or in use); a registered name's current version keeps serving.
            LoRANotEnabledError / ConfigError: a target stage without LoRA / no such stage.
        """
        lora = checked_lora_request(lora)
        if lora.lora_name in self._reserved:
            raise InvalidAdapterError(f"adapter name {lora.lora_name!r}: {self._reserved[lora.lora_name]}")
        with self._name_lock(lora.lora_name):
            old = self.get(lora.lora_name)
            if old is not None and not replace:
                raise InvalidAdapterError(f"The lora adapter '{lora.lora_name}' has already been loaded.")
            identity = self._identity(lora, fresh=reload)
            targets = self._targets(stage_id, old)
            denoiser = self._checked_denoiser(lora, denoiser, targets)
            same = old is not None and (old.int_id, old.location, old.fingerprint) == (
                lora.lora_int_id,
                identity[0],
                identity[2],
            )
            with self._lock:
                why = self._id_conflict(lora, identity[0], old)
                if why is not None:
                    raise InvalidAdapterError(
                        f"{describe_adapter(lora)}: {why}; choose another id, or remove it first"
                    )
                self._claims[lora.lora_int_id] = lora.lora_name
            try:
                return self._register(lora, identity, targets, old if same else None, old, denoiser)
            finally:
                with self._lock:
                    self._claims.pop(lora.lora_int_id, None)

    def _checked_denoiser(self, lora: LoRARequest, denoiser: Any, targets: tuple[int, ...]) -> str | None:
        """``denoiser`` as an attribute name (aliases resolved), checked against every target stage.

        Raises:
            InvalidAdapterError: not a denoiser name, or a target stage has no such denoiser.
        """
        if denoiser is None:
            return None
        try:
            name = canonical_denoiser(denoiser, f"{describe_adapter(lora)}: denoiser")
        except InvalidRequestError as exc:
            raise denoiser_error(str(exc)) from None
        denoisers = self._denoisers
        for stage in targets:
            if denoisers is None:
                break
            have = denoisers(stage)
            if have is not None and name not in have:
                given = repr(denoiser) if denoiser == name else f"{denoiser!r} ({name})"
                raise denoiser_error(
                    f"{describe_adapter(lora)}: denoiser {given} is not one of {self._stages.label(stage)}'s "
                    f"denoisers {list(have)}; name one of them, or leave denoiser unset"
                )
        return name

    def resolve_adapter(self, adapter: RequestAdapter) -> RequestAdapter:
        """One adapter of a request in the form its stage gets: its LoRA per version (:meth:`resolve`)
        and, when the request names no denoiser, the denoiser the adapter was registered for
        (``add_lora(..., denoiser=...)``)."""
        lora = self.resolve(adapter.lora)
        denoiser = adapter.denoiser
        if denoiser is None and isinstance(lora, LoRARequest):
            with self._lock:
                record = self._by_id.get(self._engine_public.get(lora.lora_int_id, -1))
            if record is not None and record.engine.lora_int_id == lora.lora_int_id:
                denoiser = record.denoiser
        return replace(adapter, lora=lora, denoiser=denoiser)

    def _register(
        self,
        lora: LoRARequest,
        identity: tuple,
        targets: tuple[int, ...],
        same: AdapterRecord | None,
        old: AdapterRecord | None,
        denoiser: str | None,
    ) -> bool:
        """Load the version on ``targets`` (pinned where ``old`` was), then swap it in and drop ``old``'s
        version from its stages. ``same``: ``old`` when the content is unchanged (its stages are asked
        again, which reloads only what they evicted). Returns whether the registry changed (a new
        adapter, version, target or denoiser)."""
        if same is not None:
            record = same
        else:
            record = self._new_record(lora, identity, denoiser=denoiser, source="add_lora")
        pinned = {s for s, st in (old.stages.items() if old else ()) if st.state == "pinned" or st.pinned}
        try:
            states = self._stages.load(record, targets, pinned, repin=same is None)
        except LoRACacheError as exc:
            if old is None or same is not None:
                raise
            raise AdapterUpdateRefusedError(
                f"{exc}; the new version was not loaded and version {old.version} of {old.name!r} keeps "
                f"serving (reload it once there is room)"
            ) from exc
        new_targets = tuple(dict.fromkeys(record.targets + targets))
        changed = same is None or new_targets != record.targets or denoiser not in (None, record.denoiser)
        record = replace(
            record,
            targets=new_targets,
            stages={**record.stages, **states},
            denoiser=denoiser or record.denoiser,
            registered=True,
            version=(old.version + 1) if old is not None and same is None else record.version,
        )
        with self._lock:
            self._lost.forget(record.int_id, targets)
            self._refused.pop(record.int_id, None)
            if old is not None and old.int_id != record.int_id:
                self._by_id.pop(old.int_id, None)
            self._names.pop(lora.lora_name, None)
            self._names[lora.lora_name] = record.int_id
            self._by_id[record.int_id] = record
        if old is not None and same is None and old.engine.lora_int_id != record.engine.lora_int_id:
            self._stages.unload(old.engine, old.targets)
        return changed

    def adopt(
        self, lora: LoRARequest, stage_id: int, *, pinned: bool = True, source: str = "lora_path"
    ) -> None:
        """Register an adapter a stage loaded by itself at start-up under ``lora`` (its id and name as the
        stage uses them). A name taken already keeps its adapter (the new one is known by id only).

        Raises:
            InvalidAdapterError / FileNotFoundError: its files cannot be read.
        """
        identity = self._identity(lora)
        with self._lock:
            self._engine_owner[lora.lora_int_id] = (identity[0], identity[2])
            self._engine_public[lora.lora_int_id] = lora.lora_int_id
            state = {stage_id: StageState("pinned" if pinned else "loaded")}
            record = AdapterRecord(
                lora.lora_name, lora.lora_int_id, identity[0], identity[1], identity[2], lora,
                targets=(stage_id,), stages=state, source=source, signature=identity[3],
            )  # fmt: skip
            self._by_id[lora.lora_int_id] = record
            if lora.lora_name not in self._names:
                self._names[lora.lora_name] = lora.lora_int_id
            else:
                logger.warning(
                    "start-up adapter %s: the name is taken; known by id only", describe_adapter(lora)
                )

    # ------------------------------------------------------------------ management
    def remove(self, int_id: int, stage_id: int | None = None) -> bool:
        """Drop adapter ``int_id`` (every version of it) from ``stage_id`` or from every stage, and forget
        it once no target is left. ``True`` if a stage held it.

        Raises:
            LoRANotEnabledError: no (selected) stage takes adapters.
        """
        record = self.by_id(int_id)
        if record is None:
            return any(self._call("remove_lora", int_id, stage_id=stage_id).values())
        with self._name_lock(record.name):
            return self._remove_held(int_id, stage_id)

    def _remove_held(self, int_id: int, stage_id: int | None) -> bool:
        """:meth:`remove` with the adapter's name lock held."""
        with self._lock:
            record = self._by_id.get(int_id)
            engine_ids = [e for e, p in self._engine_public.items() if p == int_id]
        removed = False
        for engine_id in engine_ids or [int_id]:
            removed |= any(self._call("remove_lora", engine_id, stage_id=stage_id).values())
        if record is None:
            return removed
        with self._lock:
            self._lost.forget(int_id, None if stage_id is None else (stage_id,))
            self._refused.clear()  # room was freed: requests try refused versions again
            left = tuple(t for t in record.targets if t != stage_id) if stage_id is not None else ()
            if left:
                stages = {s: st for s, st in record.stages.items() if s != stage_id}
                self._by_id[int_id] = replace(record, targets=left, stages=stages)
            elif self._by_id.get(int_id) is record:
                del self._by_id[int_id]
                if self._names.get(record.name) == int_id:
                    del self._names[record.name]
        return removed

    def remove_name(self, name: str) -> AdapterRecord | None:
        """Unregister the adapter called ``name`` from every stage; the record, or ``None`` if no adapter
        of that name is registered when the call gets the name's lock: of concurrent calls for one
        registration exactly one gets the record (a serial history: one removal, then "not found")."""
        with self._name_lock(name):
            record = self.get(name)
            if record is not None:
                self._remove_held(record.int_id, None)
            return record

    def pin(self, int_id: int, stage_id: int | None = None) -> bool:
        """Pin adapter ``int_id`` (never evicted) on ``stage_id``, or on its target stages (every LoRA stage
        for one only seen in requests). ``True`` when every stage pinned it.

        Raises:
            the stage's error (e.g. not loaded there), naming the adapter.
        """
        record = self.by_id(int_id)
        if record is None:
            return all(self._call("pin_lora", int_id, stage_id=stage_id).values())
        with self._name_lock(record.name):
            stages = (stage_id,) if stage_id is not None else (record.targets or (None,))
            results: dict[int, Any] = {}
            for stage in stages:
                results.update(self._call("pin_lora", record.engine.lora_int_id, stage_id=stage))
            with self._lock:
                current = self._by_id.get(int_id)
                if current is not None:
                    pinned = {s: StageState("pinned") for s in results if s in current.targets}
                    self._by_id[int_id] = replace(current, stages={**current.stages, **pinned})
            return all(results.values())

    def list_ids(self, stage_id: int | None = None) -> set[int]:
        """Public ids of the adapters the stages hold (``stage_id``, or every LoRA stage)."""
        held: set[int] = set()
        for ids in self._call("list_loras", stage_id=stage_id).values():
            held |= set(ids)
        return {self.public_id(i) for i in held}
