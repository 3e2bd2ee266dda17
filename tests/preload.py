"""Start the suite's Python subprocesses from an interpreter that has already imported vLLM.

Why: every Python process that imports vLLM pays ~16 s of CPU first on the 2-core CI machine
(``docs/contributing_docs.md``, *Test suite cost*), and the suite starts ~60 servers, docs scripts
and examples. :func:`popen` and :func:`run` are drop-in replacements for ``subprocess.Popen`` /
``subprocess.run`` for commands of the form ``python -m module ...``, ``python script.py ...``
and this venv's console scripts (``vllm-omni``, ``vllm``): the command runs in a process forked
from a *zygote*, a Python interpreter that imported :data:`PRELOAD` and then waits; the child
sets its argv, cwd, environment and stdio and runs the script or module as ``__main__``
(``runpy``), as the fresh interpreter would. What the child does after that (its own
``multiprocessing`` spawns, engine processes, Ray) is unchanged, except that its stage workers
and diffusion ranks start from the zygote's worker fork server, a fork of the zygote
(``tests.fork_server.share_forked_server``): they are that fork server's
children, not the command's, and follow the command's process (``popen(..., own_workers=True)`` for a test of a
command's process tree).

Fidelity rules (when a command is *not* forked but run as written, by ``subprocess``):
- the environment decides at import time for some variables (``OMP_NUM_THREADS`` when libgomp
  loads, ``HF_HUB_OFFLINE`` in ``huggingface_hub.constants``, ``PYTHON*`` at start-up, vLLM's
  logging): a zygote serves only requests whose environment equals its own except for
  :data:`READ_LATER`, variables read after import (checked by ``tests/test_preload.py``). Other
  environments get their own zygote, at most :data:`MAX_ZYGOTES` per test process;
- interpreter options (``python -X ...``, ``-u``) and anything that is not a Python file of this
  venv run as written;
- ``VLLM_OMNI_TEST_FRESH_INTERPRETERS=1`` runs everything as written (to check a failure).
The zygote is single-threaded in Python and has run no torch op when it forks (libgomp's thread
pool starts in each child at its first parallel region).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

#: What a zygote imports before it forks (what servers, docs scripts and examples import).
PRELOAD = ("vllm_omni", "vllm_omni.entrypoints.cli.main", "vllm_omni.entrypoints.openai.api_server")
#: Variables that no import reads: a request may differ from its zygote in these.
READ_LATER = frozenset({
    "PYTEST_CURRENT_TEST", "COLUMNS", "LINES",
    "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_OMNI_CACHE_ROOT", "VLLM_OMNI_MAX_REQUEST_BODY_MB", "VLLM_DIST_IDENT",
})  # fmt: skip
MAX_ZYGOTES = 3
_DISABLED = os.environ.get("VLLM_OMNI_TEST_FRESH_INTERPRETERS") == "1"
_BIN = Path(sys.executable).parent
#: The zygote's working directory, first on its ``sys.path`` (``python -c``): the checkout these tests
#: belong to, so that it imports this tree's ``vllm_omni`` (not the one the venv's editable install
#: names, another worktree's when the venv is shared).
_REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the zygote side
def _zygote_main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    import importlib

    names = sys.argv[2].split(",")
    environ = dict(os.environ)
    for name in names:
        importlib.import_module(name)
    envs = sys.modules.get("vllm.envs")
    if envs is not None and envs._is_envs_cache_enabled():  # then READ_LATER would not hold: refuse to serve
        raise RuntimeError("vllm.envs caches the environment after the preload imports")
    fork_server = None
    if "vllm_omni" in names:
        # the workers' fork server, forked from here (no import of its own) and shared with every
        # command forked from here: a server or script then pays no worker import either
        from tests.fork_server import share_forked_server

        with contextlib.suppress(ValueError):  # a bad VLLM_OMNI_WORKER_START: each command reports it
            fork_server = share_forked_server(environ)
    _send(sock, {"ready": os.getpid(), "fork_server": fork_server})
    import select

    while True:
        _reap(sock)
        if not select.select([sock], [], [], 0.2)[0]:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not msg:  # the test process is gone
            return
        req = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            _child(sock, req, fds)  # never returns
        for fd in fds:
            os.close(fd)
        _send(sock, {"spawned": pid, "id": req["id"]})


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall(json.dumps(msg).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status, usage = os.wait3(os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        cpu_s = usage.ru_utime + usage.ru_stime  # the child and the descendants it reaped
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status), "cpu_s": cpu_s})


def _child(sock: socket.socket, req: dict, fds: list[int]) -> None:
    code, die_by = 1, None
    try:
        sock.close()
        if req["new_session"]:
            os.setsid()
        if req["sigint_default"]:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        if req["own_workers"] and "tests.fork_server" in sys.modules:
            sys.modules["tests.fork_server"].use_own_fork_server()  # workers it descends from
        os.chdir(req["cwd"])
        if "multiprocessing.process" in sys.modules:  # the start-up directory spawned children resolve from
            sys.modules["multiprocessing.process"].ORIGINAL_DIR = req["cwd"]
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = list(req["argv"])
        sys.path[0] = (
            os.path.dirname(os.path.abspath(req["target"])) if req["kind"] == "path" else os.getcwd()
        )
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()  # as a fresh interpreter: its own entropy
        import runpy

        if req["kind"] == "path":
            _run_script(req["target"])
        else:
            sys.modules.pop(req["target"], None)  # preloaded: run a fresh copy, as ``python -m`` does
            runpy.run_module(req["target"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # as the interpreter: the hook prints it (our frames left out); exit 1
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the hook prints exc.__traceback__
        if isinstance(exc, KeyboardInterrupt):
            die_by = signal.SIGINT  # CPython ends by SIGINT then, so the parent sees -2
    finally:
        _exit_like_python(code, die_by)


def _run_script(path: str) -> None:
    """``python path``: the file's code in a new ``__main__`` module (``sys.argv`` as set; unlike
    ``runpy.run_path``, which would set ``sys.argv[0]`` to ``path``)."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__, main.__cached__, main.__builtins__ = path, None, builtins
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    exec(code, main.__dict__)


def _exit_like_python(code: int, die_by: int | None = None) -> None:
    """What the interpreter does when ``__main__`` ends: join threads, run atexit, flush; exit
    with ``code`` (or by the signal ``die_by``)."""
    try:
        threading._shutdown()  # non-daemon threads, as at a normal interpreter exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        if die_by is not None:
            signal.signal(die_by, signal.SIG_DFL)
            os.kill(os.getpid(), die_by)
    finally:
        os._exit(code & 0xFF)


# ----------------------------------------------------------------------------- the test side
class ForkedProcess:
    """The part of ``subprocess.Popen``'s interface the suite uses, for a forked command."""

    def __init__(self, zygote: _Zygote, pid: int, args: list[str], stdout=None, stderr=None):
        self._zygote, self.pid, self.args = zygote, pid, args
        self.stdout, self.stderr, self.stdin = stdout, stderr, None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple:
        out = _Drain(self.stdout)
        err = _Drain(self.stderr)
        self.wait(timeout)
        return out.result(), err.result()


class _Drain:
    def __init__(self, f):
        self._f, self._data = f, None
        if f is not None:
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()

    def _read(self) -> None:
        self._data = self._f.read()
        self._f.close()

    def result(self):
        if self._f is None:
            return None
        self._thread.join()
        return self._data


class _Zygote:
    def __init__(self, env: dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.NamedTemporaryFile(prefix="omni-zygote-", suffix=".log", delete=False)  # noqa: SIM115
        code = f"import runpy; runpy.run_path({__file__!r}, run_name='__omni_zygote__')"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), ",".join(PRELOAD)], pass_fds=(theirs.fileno(),), env=env,
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(_REPO),
        )  # fmt: skip
        theirs.close()
        self._sock = ours
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._spawned: dict[int, int] = {}
        self._pids: set[int] = set()
        self._children_cpu_s = 0.0  # what this zygote reported of its children
        self._ids = iter(range(1 << 62))
        self._ready = False
        self._gone = False
        self.fork_server: int | None = None  # the workers' fork server it shares with its commands
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, name="omni-zygote-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self._gone = True
                    self._cond.notify_all()
                    return
                msg = json.loads(data)
                if "ready" in msg:
                    self._ready = True
                    self.fork_server = msg["fork_server"]
                elif "spawned" in msg:
                    self._spawned[msg["id"]] = msg["spawned"]
                    self._pids.add(msg["spawned"])
                else:
                    self._exits[msg["exit"]] = msg["code"]
                    self._children_cpu_s += msg["cpu_s"]
                    _add_reaped_cpu(msg["cpu_s"])
                self._cond.notify_all()

    def _wait_for(self, what, timeout: float | None = None):
        """Wait for ``what()`` (not None) while the zygote lives; ``timeout=None``: no cap."""
        seen = []

        def done() -> bool:
            value = what()
            if value is not None:
                seen.append(value)
            return bool(seen) or self._gone

        with self._cond:
            if not self._cond.wait_for(done, timeout):
                return None
            if not seen:
                raise RuntimeError(f"the zygote (pid {self.proc.pid}) exited:\n{self.log_tail()}")
            return seen[0]

    def log_tail(self) -> str:
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-40:])

    def spawn(self, kind: str, target: str, argv: list[str], env: dict, cwd: str, fds: list[int],
              new_session: bool, sigint_default: bool = False, own_workers: bool = False) -> int:  # fmt: skip
        self._wait_for(lambda: True if self._ready else None)  # the import: minutes at a high load
        rid = next(self._ids)
        req = {"id": rid, "kind": kind, "target": target, "argv": argv, "env": env, "cwd": cwd,
               "new_session": new_session, "sigint_default": sigint_default, "own_workers": own_workers}  # fmt: skip
        with self._send_lock:
            socket.send_fds(self._sock, [json.dumps(req).encode()], fds)
        return self._wait_for(lambda: self._spawned.pop(rid, None))

    def running(self) -> bool:
        """Whether a process this zygote forked has not been reported as exited."""
        with self._cond:
            return any(pid not in self._exits for pid in self._pids)

    def workers_cpu_s(self) -> float:
        """CPU seconds of the workers its fork server has reaped; 0 once the fork server is gone
        (the zygote reaps it: then its CPU reaches ``os.times()`` here when the zygote is reaped)."""
        if self.fork_server is None or self._gone:
            return 0.0
        return reaped_by(self.fork_server)

    def close(self) -> None:
        """End the zygote (it exits when its socket closes); its log file goes too."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._cond:
            self._gone = True  # from now on its workers' CPU reaches os.times() with it
        self.proc.wait()
        # reaping the zygote added its children's CPU to os.times() here: do not count it twice
        _add_reaped_cpu(-self._children_cpu_s)
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        return self._wait_for(lambda: self._exits.get(pid), timeout)


_zygotes: dict[tuple, _Zygote] = {}
_zygotes_lock = threading.Lock()
_reaped_cpu_s = 0.0
_reaped_lock = threading.Lock()  # not _zygotes_lock: readers take it while holding their condition


def _add_reaped_cpu(seconds: float) -> None:
    global _reaped_cpu_s
    with _reaped_lock:
        _reaped_cpu_s += seconds


def reaped_cpu_s() -> float:
    """CPU seconds (user + system) of the forked processes that have exited so far, with their
    reaped descendants (the workers of the zygotes' shared fork servers included): what
    ``os.times().children_*`` would count had this process forked them."""
    with _zygotes_lock:
        workers = sum(z.workers_cpu_s() for z in _zygotes.values())
    return _reaped_cpu_s + workers


def reaped_by(pid: int) -> float:
    """CPU seconds of the children that the live process ``pid`` has reaped (``cutime + cstime``
    of ``/proc/<pid>/stat``, user + system); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def shared_fork_servers() -> list[int]:
    """Pids of the live zygotes' worker fork servers: the workers of a forked command are their
    children, not the command's (unless it was started with ``own_workers=True``)."""
    with _zygotes_lock:
        return [z.fork_server for z in _zygotes.values() if z.fork_server is not None and not z._gone]


@atexit.register
def _remove_logs() -> None:
    for z in _zygotes.values():
        with contextlib.suppress(OSError):
            os.unlink(z._log.name)


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in READ_LATER))


def _zygote_for(env: dict[str, str]) -> _Zygote | None:
    key = _key(env)
    with _zygotes_lock:
        z = _zygotes.pop(key, None)
        if z is None or z._gone:
            idle = [k for k, other in _zygotes.items() if not other.running()]
            while len(_zygotes) >= MAX_ZYGOTES and idle:
                _zygotes.pop(idle.pop(0)).close()  # the least recently used one with no process running
            if len(_zygotes) >= MAX_ZYGOTES:
                return None
            z = _Zygote({k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"})
        _zygotes[key] = z  # most recently used last
        return z


def _plan(cmd) -> tuple[str, str, list[str]] | None:
    """``(kind, target, argv)`` of a command a zygote can run, else ``None``."""
    if isinstance(cmd, (str, bytes)) or not cmd:
        return None
    cmd = [str(c) for c in cmd]
    exe, rest = cmd[0], cmd[1:]
    if os.path.realpath(exe) == os.path.realpath(sys.executable) and os.path.abspath(exe) == sys.executable:
        if rest[:1] == ["-m"] and len(rest) >= 2:
            import importlib.util

            spec = importlib.util.find_spec(rest[1])
            if spec is None or spec.origin is None or spec.submodule_search_locations is not None:
                return None
            return "module", rest[1], [spec.origin, *rest[2:]]
        if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
            return "path", rest[0], rest
        return None
    path = Path(exe)
    if path.parent == _BIN and path.is_file():
        with open(path, "rb") as f:
            first = f.readline().strip()
        if first.startswith(b"#!") and os.path.realpath(first[2:].decode()) == os.path.realpath(
            sys.executable
        ):
            return "path", str(path), cmd
    return None


def popen(cmd, *, stdin=None, stdout=None, stderr=None, cwd=None, env=None, start_new_session=False,
          text=False, sigint_default=False, own_workers=False, **kwargs):  # fmt: skip
    """``subprocess.Popen(cmd, ...)``, forked from a zygote where the module docstring allows.

    ``sigint_default``: the command gets SIGINT's default disposition (Python raises
    ``KeyboardInterrupt``) even when this process ignores SIGINT, as a shell's background job
    (``nohup``, ``&``) starts pytest. ``own_workers``: the command's workers start from a fork
    server of its own, so they are its descendants (as for a command run as written); by default
    they start from the zygote's (:func:`shared_fork_servers`). ``stdin=PIPE`` and other
    ``Popen`` arguments run as written.
    """
    env = dict(os.environ if env is None else env)
    plan = None if (_DISABLED or kwargs or stdin == subprocess.PIPE) else _plan(cmd)
    zygote = _zygote_for(env) if plan else None
    if zygote is None:
        if sigint_default:
            kwargs["preexec_fn"] = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
        return subprocess.Popen(cmd, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env,
                                start_new_session=start_new_session, text=text, **kwargs)  # fmt: skip
    kind, target, argv = plan
    if kind == "path":
        target = os.path.join(cwd or os.getcwd(), target)
    opened: list[int] = []
    readers = {}

    def fd_of(spec, name: str, default: int) -> int:
        if spec is None:
            return default
        if spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
        elif spec == subprocess.PIPE:
            r, fd = os.pipe()
            readers[name] = open(r, "r" if text else "rb")  # noqa: SIM115 - the caller's to read
        elif isinstance(spec, int):
            return spec
        else:
            return spec.fileno()
        opened.append(fd)
        return fd

    in_fd = fd_of(stdin, "stdin", 0)
    out_fd = fd_of(stdout, "stdout", 1)
    err_fd = out_fd if stderr == subprocess.STDOUT else fd_of(stderr, "stderr", 2)
    try:
        pid = zygote.spawn(kind, target, argv, env, str(cwd or os.getcwd()), [in_fd, out_fd, err_fd],
                           start_new_session, sigint_default, own_workers)  # fmt: skip
    finally:
        for fd in opened:
            os.close(fd)
    return ForkedProcess(zygote, pid, [str(c) for c in cmd], readers.get("stdout"), readers.get("stderr"))


def run(cmd, *, capture_output=False, timeout=None, check=False, text=False, stdout=None, stderr=None,
        **kwargs) -> subprocess.CompletedProcess:  # fmt: skip
    """``subprocess.run(cmd, ...)`` through :func:`popen`."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    if "input" in kwargs:
        return subprocess.run(
            cmd, timeout=timeout, check=check, text=text, stdout=stdout, stderr=stderr, **kwargs
        )
    proc = popen(cmd, stdout=stdout, stderr=stderr, text=text, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result


if __name__ == "__omni_zygote__":
    _zygote_main()
