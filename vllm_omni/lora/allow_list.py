"""Where adapter files may be read from (the server's ``--lora-dirs``), checked at every read.

An adapter registered from inside a root can leave it later: its folder replaced by a symlink to
another place, a file inside it replaced by a symlink out. The check therefore runs whenever the
adapter's files are about to be read, not only when the adapter was first named: at registration,
at every reload (``load_inplace``, a request finding the files changed on disk), and before a
restarted worker or replica loads it again (:meth:`vllm_omni.lora.registry.AdapterRegistry.expected_on`).
Each time, the location and every file that will be opened (``adapter_config.json``, the weights) are
resolved with ``realpath`` and must lie inside a root, or be a location the server trusts (adapters
given at start-up, hub snapshots it fetched itself).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

from vllm.lora.request import LoRARequest

from vllm_omni.errors import AdapterFileNotAllowedError, InvalidAdapterError
from vllm_omni.lora.adapter_files import AdapterFiles, locate_adapter
from vllm_omni.lora.tensor_request import TensorLoRARequest

logger = logging.getLogger(__name__)


def inside(path: str, root: str) -> bool:
    """Whether the resolved ``path`` is ``root`` or lies below it (both already ``realpath``-ed)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class AdapterFileAllowList:
    """The roots adapter files may resolve into, and the locations trusted as they are.

    Args:
        roots: allowed directories (resolved with ``realpath`` here).
        trusted: adapter locations accepted wherever they are (``realpath``-ed), e.g. start-up adapters.
    """

    def __init__(self, roots: Iterable[str], trusted: Iterable[str] = ()) -> None:
        self.roots = [os.path.realpath(r) for r in roots]
        self.trusted: set[str] = {os.path.realpath(t) for t in trusted}

    def trust(self, location: str) -> str:
        """Accept ``location`` (resolved) wherever it lies; returns the resolved path."""
        real = os.path.realpath(location)
        self.trusted.add(real)
        return real

    def allows(self, path: str) -> bool:
        """Whether ``path`` resolves inside a root."""
        real = os.path.realpath(path)
        return any(inside(real, root) for root in self.roots)

    def file_outside(self, files: AdapterFiles, shown: str) -> str | None:
        """The first file the adapter would be read from that resolves outside every root, named as
        the client sees it (``shown`` is the adapter's path as given), or ``None``."""
        for opened in (files.weights, files.config):
            if opened is None or self.allows(opened):
                continue
            if opened == files.weights and not files.is_directory:
                return shown
            folder = shown if files.is_directory else os.path.dirname(shown)
            return os.path.join(folder, os.path.basename(opened))
        return None

    def check_read(self, location: str, files: AdapterFiles, shown: str | None = None) -> None:
        """Refuse to read the adapter at ``location`` (whose files are ``files``) unless it resolves inside
        a root, file by file, or is trusted. Call it right before the files are read.

        Raises:
            AdapterFileNotAllowedError: naming the folder or file (as ``shown``, default ``location``)
                that now resolves outside the roots, and where it leads.
        """
        shown = location if shown is None else shown
        real = os.path.realpath(location)
        if real in self.trusted:
            return
        if not any(inside(real, root) for root in self.roots):
            raise AdapterFileNotAllowedError(
                f"adapter {shown!r} resolves to {real!r}, outside the server's --lora-dirs roots; its files "
                f"are not read (a folder or file replaced by a symlink leading out?)"
            )
        outside = self.file_outside(files, shown)
        if outside is not None:
            raise AdapterFileNotAllowedError(
                f"adapter file {outside!r} resolves outside the server's --lora-dirs roots; it is not read "
                f"(every file of an adapter must lie inside them, at every read)"
            )


class RefusedRestore(LoRARequest, kw_only=True):  # type: ignore[call-arg]  # a msgspec Struct (vLLM, not analysed)
    """An adapter a restarting worker must not load again: reading its files now is refused
    (``refusal`` says why, naming the file); the restart reports it as not restored."""

    refusal: str = ""


def refuse_unreadable(
    request: LoRARequest, check: Callable[[str, AdapterFiles, str], None] | None, stage_id: int
) -> LoRARequest:
    """``request`` as a restarting worker of ``stage_id`` should get it: itself, or a
    :class:`RefusedRestore` when ``check`` (:meth:`AdapterFileAllowList.check_read`) refuses its files now
    (logged). Files that cannot be found pass: the stage then says so itself. In-memory adapters pass."""
    if check is None or isinstance(request, TensorLoRARequest) or not request.lora_path:
        return request
    location = str(request.lora_path)
    try:
        check(location, locate_adapter(location), location)
    except AdapterFileNotAllowedError as exc:
        logger.warning("not restoring adapter %r on stage %d: %s", request.lora_name, stage_id, exc)
        return RefusedRestore(request.lora_name, request.lora_int_id, location, refusal=str(exc))
    except (OSError, InvalidAdapterError):
        pass
    return request
