"""How our worker processes start: forked from a preloaded interpreter, or spawned fresh.

Two kinds of workers start here: ``mp`` stage workers (:mod:`vllm_omni.engine.workers.client`)
and the tensor-parallel ranks of a diffusion stage (:class:`vllm_omni.diffusion.engine.DiffusionEngine`).
This module imports only the standard library (and :mod:`vllm_omni.log_noise`,
:mod:`vllm_omni.process_guard`), so it sits in the lowest import layer, below the diffusion
runtime that uses it.

Why: a spawned worker is a new interpreter that imports torch and vLLM again before it loads
its stage (about 7-16 s of CPU on a 2-core machine), once per stage, per replica, per rank and
per restart. The default (:data:`START_ENV` unset or ``forkserver``) starts the worker from
``multiprocessing``'s *fork server*: a process started once per driver process that imports
:data:`PRELOAD` (the workers' entry modules, hence torch and vLLM) and then forks one child per
worker. Every later worker of the process (each stage, replica, rank, restart, each ``Omni`` or
``DiffusionEngine`` a test builds) pays no import; ``vllm-omni serve`` starts the fork server
first thing (:func:`start_preloaded`), so its import runs on another core while the command
imports vLLM to parse its flags. A process that is itself a forked worker (an ``mp`` worker whose
diffusion stage has several ranks) starts a fork server of its own for its children, so they
die with it.

Why a fork server rather than forking the driver itself: the driver has run torch ops and runs
threads (engine, HTTP server, stage drivers) when it starts workers; ``fork`` of such a process
copies locks held by other threads and libgomp's thread pool, which the child cannot use. The
fork server has run no torch op and runs one Python thread when it forks (as the test suite's
zygote, ``tests/preload.py``).

Fidelity (what a spawned worker would have):

- environment: the child gets the driver's environment at the time of the start plus the
  worker's ``env`` (and the variables the preload imports set, as a spawned worker's imports
  would), set before the stage is built. ``OMP_NUM_THREADS`` is applied with
  ``torch.set_num_threads`` (libgomp read it when the fork server imported torch);
  ``CUDA_VISIBLE_DEVICES`` is read when CUDA initialises, after the fork (the fork server only
  imports: nothing in :data:`PRELOAD` initialises CUDA, and a rank picks its device with
  ``torch.cuda.set_device`` in :class:`~vllm_omni.diffusion.worker.DiffusionWorker`, after the
  fork). Any other variable that
  differs from the fork server's environment and is not in :data:`READ_AFTER_IMPORT` may have
  been read at import time: that worker is spawned instead (the reason logged at DEBUG);
- stdout / stderr: the driver's current ones (passed as file descriptors), not the fork
  server's; working directory, ``sys.path``, ``sys.argv`` and the main module as for spawn
  (``multiprocessing`` sends them to every child);
- lifetime: the worker's parent watch (:mod:`vllm_omni.process_guard`) follows the driver that
  asked for it, not the fork server (:func:`~vllm_omni.process_guard.follow`): it exits when the
  driver does, SIGKILL included. The worker closes its copy of the fork server's "alive" pipe, so
  the fork server exits when the driver does. At a normal exit the driver waits (at most
  :data:`STOP_WAIT_S`) for the fork server, which skips the interpreter's teardown: its CPU time
  (and its workers') counts in the driver's ``RUSAGE_CHILDREN``.

Lifetime: the fork server holds torch and vLLM (hundreds of MB). Every user of it (an ``mp``
stage runtime, a diffusion engine with several ranks) holds it from its start to its shutdown
(:func:`hold` / :func:`release`); when the last one of this process shuts down, the fork server ends
(:data:`IDLE_ENV` seconds later when that variable is set, default 0: at once), so a process that goes
on after ``Omni.shutdown()`` keeps no child of it. The next pipeline starts a new one. (``multiprocessing``'s
resource tracker, a small process without torch, stays: it unlinks leaked shared memory at exit.)

A process that forks drivers from a preloaded interpreter (the test suite's zygotes,
``tests/fork_server.py``) can fork its fork server from itself and share it with them: neither the
fork server nor a forked driver's workers import anything; the workers are the shared fork
server's children and follow their driver as above. A forked driver uses a shared fork server
(:data:`_shared` set by the launcher) and never stops it.

``VLLM_OMNI_WORKER_START=spawn`` starts every worker as a fresh interpreter (as before).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

#: Environment variable choosing how workers start: ``forkserver`` (default) or ``spawn``.
START_ENV = "VLLM_OMNI_WORKER_START"
START_METHODS = ("forkserver", "spawn")
#: Modules the fork server imports before it forks workers: this module, the entry modules of an
#: ``mp`` stage worker and of a diffusion tensor-parallel rank (torch, vLLM; a pipeline's own
#: module, diffusers included, is imported by the rank that builds it: ~0.7 s of CPU that a
#: process without diffusion stages never pays).
PRELOAD = ("vllm_omni.worker_start", "vllm_omni.engine.workers.mp", "vllm_omni.diffusion.engine")
#: Variables no import reads (or that the child applies itself): a worker's environment may
#: differ from the fork server's in these and still be forked.
READ_AFTER_IMPORT = frozenset({
    "OMP_NUM_THREADS",  # applied with torch.set_num_threads
    "CUDA_VISIBLE_DEVICES",  # read when CUDA initialises
    "OMNI_STAGE_OWNER_PID",  # process_guard, read by watch_parent
    "OMNI_DEMOTE_KNOWN_LOG_NOISE",  # log_noise, installed again in the child
    "VLLM_CPU_OMP_THREADS_BIND", "VLLM_USE_AOT_COMPILE", "VLLM_DIST_IDENT",
    "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_OMNI_CACHE_ROOT", "VLLM_OMNI_MAX_REQUEST_BODY_MB", START_ENV, "VLLM_OMNI_WORKER_SERVER_IDLE_S",
    "PYTEST_CURRENT_TEST", "COLUMNS", "LINES",
    # ray.init() sets these in the driver's environment and never restores them; Ray reads them
    # when it is called, and PYTHONBREAKPOINT is read at each breakpoint() (a process that used
    # the ray backend once would otherwise spawn every later mp worker)
    "PYTHONBREAKPOINT", "RAY_CLIENT_MODE", "RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED",
})  # fmt: skip

#: Environment variable: seconds the fork server stays after the last pipeline of its process shut
#: down (:func:`release`; default ``0``: it ends then).
IDLE_ENV = "VLLM_OMNI_WORKER_SERVER_IDLE_S"
#: Set in the fork server's environment while it starts (it then ends without the interpreter's teardown).
SERVER_MARK = "OMNI_WORKER_FORK_SERVER"
#: Seconds the driver waits at exit for its fork server to end.
STOP_WAIT_S = 5.0
#: Held while a worker is started (the spawn path puts the worker's env in this process's environment).
START_LOCK = threading.Lock()
_server_env: dict[str, str] | None = None  # the environment the running fork server started with
_server_pid: int | None = None
_started_by: int | None = None  # the process that started it (a fork of it has none)
_server_after: tuple[int | None, dict[str, str]] | None = None  # (fork server pid, its env after imports)
_PROBE_LOCK = threading.Lock()
_forked = False  # whether this process's fork server has forked a worker (so it has imported its preload)
_shared = False  # whether this process's fork server is shared with its forks (set by such a launcher)
_holders: set[int] = set()  # ids of the users of the fork server (hold / release)
_idle_timer: threading.Timer | None = None
#: In a worker: whether ``vllm`` was imported before the worker's entry point ran (it was preloaded).
preloaded_at_entry = False


def _mp_fork_server() -> Any:
    """``multiprocessing``'s fork-server singleton. Its pid, address and "alive" pipe are private
    attributes (no public API reads them or stops the server), so they are read and reset here."""
    from multiprocessing import forkserver

    return forkserver._forkserver  # type: ignore[attr-defined]


def start_method() -> str:
    """The start method of this process's workers (:data:`START_ENV`, default ``forkserver``).

    Raises:
        ValueError: :data:`START_ENV` is set to something else than :data:`START_METHODS`.
    """
    value = os.environ.get(START_ENV, "forkserver").strip().lower() or "forkserver"
    if value not in START_METHODS:
        raise ValueError(f"{START_ENV}={value!r}: expected one of {', '.join(START_METHODS)}")
    return value


def start_preloaded() -> bool:
    """Start this process's fork server now, if workers fork (idempotent; imports neither torch
    nor vLLM here: the fork server imports them in its own process).

    In a process forked from one that shares its fork server (:data:`_shared`, set by such a
    launcher: ``tests/fork_server.py``), that fork server is used; a fork server inherited without
    sharing is left to the process that started it.

    Returns:
        True when a fork server runs (started now, before, or shared by the process this one
        was forked from).
    """
    global _server_env, _server_pid, _started_by, _forked, _shared
    if start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    with START_LOCK:
        server = _mp_fork_server()
        if _started_by not in (None, os.getpid()):  # inherited through fork(): its parent's
            if _shared and _alive(server._forkserver_pid):
                server.ensure_running = _ensure_shared_running  # it is not our child: no waitpid
                return True
            server.__dict__.pop("ensure_running", None)
            server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
            _shared = False
        forkserver.set_forkserver_preload(list(PRELOAD))
        env = dict(os.environ)
        os.environ[SERVER_MARK] = "1"
        try:
            forkserver.ensure_running()  # starts it with ``env``; restarts one that died
        finally:
            os.environ.pop(SERVER_MARK, None)
        if server._forkserver_pid != _server_pid or _started_by != os.getpid():
            _server_env, _server_pid, _started_by = env, server._forkserver_pid, os.getpid()
            _forked = False
            logger.debug("worker fork server %d started (preloads %s)", _server_pid, ", ".join(PRELOAD))
    return True


def idle_seconds() -> float:
    """:data:`IDLE_ENV` in seconds (``0`` when unset).

    Raises:
        ValueError: it is not a number >= 0 (naming the variable).
    """
    raw = os.environ.get(IDLE_ENV, "").strip() or "0"
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise ValueError(f"{IDLE_ENV}={raw!r}: expected a number of seconds >= 0")
    return value


def hold(owner: object) -> None:
    """``owner`` (a stage runtime, a diffusion engine) starts workers from this process's fork server
    until :func:`release`: the fork server is not stopped meanwhile (a pending idle stop is cancelled)."""
    global _idle_timer
    with START_LOCK:
        _holders.add(id(owner))
        if _idle_timer is not None:
            _idle_timer.cancel()
            _idle_timer = None


def release(owner: object) -> None:
    """``owner`` has shut its workers down (idempotent). When it was the last holder, the fork server
    this process started ends: now, or :func:`idle_seconds` later unless a new holder comes first.
    A fork server shared with this process by the one it was forked from is left alone.

    Raises:
        ValueError: a bad :data:`IDLE_ENV` (the fork server then ends now).
    """
    global _idle_timer
    with START_LOCK:
        if id(owner) not in _holders:
            return
        _holders.discard(id(owner))
        if _holders or _started_by != os.getpid():
            return
        try:
            idle = idle_seconds()
        except ValueError:
            _stop_server()
            raise
        if idle == 0:
            _stop_server()
            return
        _idle_timer = threading.Timer(idle, _stop_if_idle)
        _idle_timer.daemon = True
        _idle_timer.name = "omni-worker-server-idle"
        _idle_timer.start()


def _stop_if_idle() -> None:
    global _idle_timer
    with START_LOCK:
        _idle_timer = None
        if not _holders:
            _stop_server()


def server_pid() -> int | None:
    """The pid of the fork server this process's workers start from (``None``: none yet)."""

    return _mp_fork_server()._forkserver_pid


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ensure_shared_running() -> None:
    """``ForkServer.ensure_running`` in a fork of the process that shares its fork server: that
    server is not this process's child (``waitpid`` would fail), so only check that it lives."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    pid = _mp_fork_server()._forkserver_pid
    if not _alive(pid):
        raise OSError(f"the shared worker fork server {pid} is gone")


def _stop_server() -> None:
    """End the fork server this process started (killed if it never forked a worker: it may still
    be importing, seconds of CPU nobody will use) and reap it (bounded by :data:`STOP_WAIT_S`).
    Called when the last holder releases it (:func:`release`) and at this process's exit (after
    its workers were shut down); a later worker start starts a new one."""
    global _server_pid, _server_env, _forked

    server = _mp_fork_server()
    if _started_by != os.getpid() or server._forkserver_alive_fd is None:
        return
    pid = server._forkserver_pid
    with contextlib.suppress(OSError):
        os.close(server._forkserver_alive_fd)  # the fork server's loop ends when this closes
    server._forkserver_alive_fd = None
    if not _forked:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_WAIT_S
    with contextlib.suppress(ChildProcessError):
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() >= deadline:  # a fork of this process still holds the pipe
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    address = server._forkserver_address
    if isinstance(address, str) and not address.startswith("\0"):
        with contextlib.suppress(OSError):
            os.unlink(address)
    server._forkserver_pid = server._forkserver_address = None
    _server_pid, _server_env, _forked = None, None, False
    logger.debug("worker fork server %s stopped", pid)


def _exit_now() -> None:
    """The fork server's last exit handler: skip the teardown of torch / vLLM (seconds)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


atexit.register(_stop_server)  # at import: runs after the client's shutdown of live workers
if os.environ.get(SERVER_MARK) == "1" and "multiprocessing.forkserver" in sys.modules:
    atexit.register(_exit_now)  # this process is the fork server, importing its preload


def _report_env(conn: Any) -> None:
    """Fork-server child: send the fork server's environment (after its imports) and exit."""
    conn.send(dict(os.environ))
    conn.close()


def _server_environ() -> dict[str, str] | None:
    """The fork server's environment after its preload imports (which set variables of their own,
    e.g. ``TORCHINDUCTOR_CACHE_DIR``), asked once per fork server from a child of it; ``None``
    when the fork server died before answering."""
    global _server_after, _forked
    with _PROBE_LOCK:
        if _server_after is not None and _server_after[0] == _server_pid:
            return _server_after[1]
        ctx = multiprocessing.get_context("forkserver")
        ours, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_report_env, args=(theirs,), name="omni-fork-server-env", daemon=True)
        proc.start()
        theirs.close()
        try:
            env = ours.recv()  # the fork server forks only once its imports are done
        except (EOFError, OSError):
            return None
        finally:
            ours.close()
            proc.join(5.0)
        _forked = True
        env.pop(SERVER_MARK, None)
        _server_after = (_server_pid, env)
        return env


def _worker_environ(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The environment a forked worker gets and the variables in which it differs from the fork
    server's that an import may have read (empty: the worker may fork).

    The worker's environment is the fork server's after its imports, with every change this
    process made since the fork server started and ``env`` applied: what a spawned worker would
    have (its own imports set the same variables the fork server's did).
    """
    target = {**os.environ, **env}
    after = _server_environ()
    if after is None:
        return target, ["(the fork server is gone)"]
    base = _server_env or {}
    environ = dict(after)
    changed = [k for k in set(base) | set(target) if base.get(k) != target.get(k)]
    for key in changed:
        if key in target:
            environ[key] = target[key]
        else:
            environ.pop(key, None)
    keys = [k for k in changed if after.get(k) != environ.get(k)]
    bad = sorted(k for k in keys if k not in READ_AFTER_IMPORT)
    if "OMP_NUM_THREADS" in keys and "OMP_NUM_THREADS" not in environ:
        bad.append("OMP_NUM_THREADS")  # the server's value would stay: only a spawn drops it
    return environ, bad


def process_for(
    label: str, target: Any, args: tuple, env: Mapping[str, str], name: str, daemon: bool = False
) -> tuple[Any, str]:
    """An unstarted ``multiprocessing`` process running ``target(*args)`` as the worker of
    ``label``, and how it starts (``"forkserver"`` or ``"spawn"``).

    ``daemon``: the process's ``daemon`` flag (a daemon is terminated at this process's exit and
    may start no ``multiprocessing`` children; a stage worker is not one, a diffusion rank is).
    Start it with :func:`start_process` (the spawn path needs ``env`` in this process's
    environment while it starts). Raises ValueError for a bad :data:`START_ENV`.
    """
    how = start_method()
    if how == "forkserver":
        start_preloaded()
        environ, bad = _worker_environ(env)
        if bad:
            logger.debug(
                "%s: worker spawned as a fresh interpreter: %s differ(s) from the worker fork server's "
                "environment and may be read at import",
                label,
                ", ".join(bad),
            )
            how = "spawn"
    proc: multiprocessing.process.BaseProcess
    if how == "forkserver":
        args = (target, (_StdFd(1), _StdFd(2)), environ, os.getpid(), *args)
        proc = multiprocessing.get_context("forkserver").Process(
            target=preloaded_main, args=args, name=name, daemon=daemon
        )
    else:
        proc = multiprocessing.get_context("spawn").Process(
            target=target, args=args, name=name, daemon=daemon
        )
    return proc, how


def start_process(proc: Any, how: str, env: Mapping[str, str]) -> None:
    """``proc.start()``; for ``spawn``, with ``env`` in this process's environment meanwhile (the
    child imports torch while unpickling its arguments, and OpenMP reads ``OMP_NUM_THREADS`` when
    it loads, so setting it in the child would be too late)."""
    global _forked
    with START_LOCK:
        if how != "spawn":
            proc.start()
            _forked = True
            return
        saved = {key: os.environ.get(key) for key in env}
        try:
            os.environ.update(env)
            proc.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


class _StdFd:
    """A file descriptor of the driver (its stdout / stderr) handed to a fork-server child;
    unpickled there as a descriptor number of the child's own."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        try:
            os.fstat(self.fd)
        except OSError:  # closed in the driver: the child keeps the fork server's
            return (_none, ())
        return (_detach, (reduction.DupFd(self.fd),))


def _none() -> None:
    return None


def _detach(dup: Any) -> int:
    return dup.detach()


def preloaded_main(
    target: Any, stdio: tuple[int | None, int | None], environ: dict[str, str], driver: int, *args: Any
) -> None:
    """Entry point of a worker forked by the fork server for the process ``driver``: make the
    process look like a spawned worker of the driver (module docstring), then run ``target(*args)``."""
    global preloaded_at_entry
    from vllm_omni import process_guard

    process_guard.follow(driver)  # its parent watch follows the driver, not the fork server
    preloaded_at_entry = "vllm" in sys.modules
    atexit.unregister(_exit_now)  # registered in the fork server; this is a worker

    server = _mp_fork_server()
    if server._forkserver_alive_fd is not None:  # the fork server must end with the driver
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    for fd, std, stream in zip(stdio, (1, 2), (sys.stdout, sys.stderr), strict=True):
        if fd is None:
            continue
        with contextlib.suppress(Exception):
            stream.flush()
        os.dup2(fd, std)
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    from vllm_omni.log_noise import install_if_asked

    install_if_asked()
    torch = sys.modules.get("torch")
    threads = environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.strip().isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    target(*args)
