"""No process of ours outlives the process that started it.

The process that owns stage engines (``Omni``, ``AsyncOmni``, the server) marks itself with
:func:`mark_owner` before it starts any child; the mark is an environment variable, so every
descendant inherits it (``spawn``, ``fork`` and ``exec`` alike). A descendant that runs
:func:`watch_parent` — vLLM's engine-core and worker processes through the ``vllm_omni``
plugin (:func:`vllm_omni.platform.prepare_engine_process`), our diffusion tensor-parallel
ranks explicitly — starts a daemon thread that checks every :data:`POLL_S` seconds whether its
parent is still the process that started it. When the parent is gone (exited, crashed, killed
with SIGKILL: the child was re-parented), the child sends itself SIGTERM (vLLM's engine core
shuts down on it, releasing its own workers) and, if it is still alive :data:`GRACE_S` seconds
later, exits with ``os._exit``. Each level watches its own parent, so a whole tree unwinds.

Why not ``prctl(PR_SET_PDEATHSIG)``: Linux sends that signal when the *thread* that created
the child exits, and our stage engines are created on stage driver threads, which end at
shutdown before the engine is released; polling ``getppid`` follows the process. A process
without the mark (or the owner itself) never watches, so a server started from a shell does
not die with the shell.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Environment variable holding the pid of the process that owns the stage engines. Not
#: ``VLLM_``-prefixed: vLLM warns about (or, with ``fail_on_environ_validation``, refuses) every
#: ``VLLM_*`` variable it does not know when it builds an engine config.
OWNER_ENV = "OMNI_STAGE_OWNER_PID"
#: Seconds between two checks of the parent (a sleeping thread: no measurable cost).
POLL_S = 0.25
#: Seconds between the SIGTERM a child sends itself and its hard exit.
GRACE_S = 2.0

_lock = threading.Lock()
_watching_pid: int | None = None  # the pid whose watch thread runs (fork children re-arm)
_fork_hook_registered = False
#: ``(this process's pid, the process it follows)`` set by :func:`follow`; a fork of this
#: process (another pid) watches its own parent again.
_followed: tuple[int, int] | None = None


def mark_owner() -> None:
    """Mark this process as the owner of the stage processes it starts from now on (idempotent)."""
    os.environ[OWNER_ENV] = str(os.getpid())
    _register_fork_hook()


def is_descendant() -> bool:
    """Whether this process was started (directly or not) by a process that called :func:`mark_owner`."""
    owner = os.environ.get(OWNER_ENV)
    return bool(owner) and owner != str(os.getpid())


def watch_parent() -> bool:
    """In a descendant of the owner: exit when the parent process goes away (idempotent per process).

    Returns:
        True when a watch runs in this process (started now or before); False in the owner
        itself and in processes that do not descend from one.
    """
    global _watching_pid
    if not is_descendant():
        return False
    _register_fork_hook()
    with _lock:
        if _watching_pid == os.getpid():
            return True
        _watching_pid = os.getpid()
    target: Callable[[int], None]
    if _followed is not None and _followed[0] == os.getpid():
        target, args = _watch_followed, (_followed[1],)
    else:
        target, args = _watch, (os.getppid(),)
    thread = threading.Thread(target=target, args=args, name="vllm-omni-parent-watch", daemon=True)
    thread.start()
    return True


def follow(pid: int) -> None:
    """Make this process's watch follow ``pid`` instead of its parent (call before :func:`watch_parent`).

    For a worker forked by a fork server on behalf of ``pid`` (its driver,
    :mod:`vllm_omni.worker_start`): the fork server is its parent but may outlive the
    driver (a fork server shared by several drivers). Only this process follows ``pid``; its own
    children watch it, their parent. A ``pid`` already gone ends this process at the first
    :func:`watch_parent`.
    """
    global _followed
    _followed = (os.getpid(), pid)


def _watch(parent: int) -> None:
    while os.getppid() == parent and parent != 1:
        time.sleep(POLL_S)
    _exit_for(parent, "parent")


def _watch_followed(pid: int) -> None:
    """Wait for ``pid`` (not our parent) to end: a pidfd turns readable when it exits (Linux 5.3+;
    elsewhere ``kill(pid, 0)`` every :data:`POLL_S`, which a zombie still passes)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        pass  # already gone
    except (AttributeError, OSError):  # no pidfd here
        with contextlib.suppress(ProcessLookupError):
            while True:
                with contextlib.suppress(PermissionError):  # alive (another user's process)
                    os.kill(pid, 0)
                time.sleep(POLL_S)
    else:
        select.select([fd], [], [])
    _exit_for(pid, "driver")


def _exit_for(pid: int, what: str) -> None:
    logger.warning("vllm-omni: %s process %d is gone; process %d exits", what, pid, os.getpid())
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE_S)
    finally:
        os._exit(1)


def _register_fork_hook() -> None:
    """Threads do not survive ``fork``: a forked descendant starts its own watch."""
    global _fork_hook_registered
    with _lock:
        if _fork_hook_registered:
            return
        _fork_hook_registered = True
    os.register_at_fork(after_in_child=watch_parent)


def join_exit(proc, timeout: float) -> bool:
    """Wait at most ``timeout`` seconds for the ``multiprocessing`` process ``proc`` to exit.

    ``Process.join(timeout)`` returns as soon as the child's end of its sentinel pipe closes, which
    the kernel does while the process exits, before the process can be waited for: ``is_alive()``
    then still holds for a few milliseconds (measured with a worker that ends with ``os._exit``),
    and a caller that kills whatever is alive after ``join`` reported a clean stop as a hang. This
    waits for the exit itself, within the same bound.

    Returns:
        ``True`` when the process has exited.
    """
    deadline = time.monotonic() + max(0.0, timeout)
    proc.join(max(0.0, timeout))
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    return not proc.is_alive()
