"""Start-up inputs checked before anything heavy is imported or any engine starts.

``vllm-omni serve`` refuses, naming the flag and the value as given, an input it can tell is
wrong from the file system and the network alone:

* ``--lora-modules name=path`` / ``--lora-path`` / ``--lora-dirs``: a local path that does not
  exist or cannot be read (``--lora-dirs``: is not a directory);
* ``--deploy-config``: a file that cannot be read, is not YAML or is not a mapping (its schema is
  checked by the full parser, still before any engine starts);
* ``--host`` / ``--port``: an address this process cannot bind (in use, not permitted).

The address is bound once, here, and held while the engines load, then served on that very
socket (:func:`take_listener`). Checking it and binding it again minutes later left a window in
which another process could take the port (seen in CI: a port free at the check was in use when
the server bound it 42 s later). The held socket listens from the start, as gunicorn's does:
Linux lets a second ``SO_REUSEADDR`` socket bind a port whose owner is not listening, and a
client that connects while the engines load is answered once the server is up.

:func:`check_argv` runs on the raw command line before vLLM is imported
(:func:`vllm_omni.entrypoints.cli.fast.try_fast`): these answers take well under a second.
:func:`resolve_local` and :func:`check_bind` are used by the full parser too, so a command line
that reaches it (or a caller of :func:`~vllm_omni.entrypoints.cli.serve.parse_serve_argv`)
gets the same errors, and paths are made absolute there, once, so the server, its stages and
request paths all see one spelling of each adapter location.

Only stdlib, PyYAML and :mod:`vllm_omni.errors` are imported here.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
from collections.abc import Iterable

from vllm_omni.errors import ConfigError

#: Our value-taking flags this module checks: flag -> how many values ("+": one or more).
CHECKED_FLAGS = {
    "--lora-modules": "+",
    "--lora-path": "+",
    "--lora-dirs": "+",
    "--deploy-config": 1,
    "--host": 1,
    "--port": 1,
}


def resolve_local(flag: str, value: str, path: str, *, directory: bool = False) -> str:
    """``path`` made absolute (symlinks resolved) after checking it exists and can be read.

    Args:
        flag: the flag as the user wrote it (for the message).
        value: the value as given (for the message), e.g. ``name=path``.
        path: the local path inside ``value``.
        directory: the path must be a directory (``--lora-dirs``).

    Raises:
        ConfigError: ``<flag> <value>: <what is wrong>``.
    """
    expanded = os.path.expanduser(path)
    if not os.path.exists(expanded):
        raise ConfigError(f"{flag} {value}: no such file or directory ({os.path.abspath(expanded)})")
    if directory and not os.path.isdir(expanded):
        raise ConfigError(f"{flag} {value}: not a directory")
    need = os.R_OK | (os.X_OK if os.path.isdir(expanded) else 0)
    if not os.access(expanded, need):
        raise ConfigError(f"{flag} {value}: permission denied (cannot read it as user {os.getuid()})")
    return os.path.realpath(expanded)


def parse_lora_module(value: str) -> tuple[str, str]:
    """``name=path`` or JSON ``{"name": ..., "path": ...}`` -> ``(name, path)`` (vLLM's two forms).

    Raises:
        ConfigError: neither form.
    """
    if value.lstrip().startswith("{"):
        try:
            data = json.loads(value)
            return str(data["name"]), str(data["path"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"--lora-modules {value}: expected 'name=path' or JSON with name and path"
            ) from exc
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules {value}: expected 'name=path' or JSON with name and path")
    return name, path


def check_deploy_yaml(path: str) -> None:
    """The deploy YAML can be read and is a mapping (its schema is checked later, still before engines).

    Raises:
        ConfigError: naming the file: unreadable, not UTF-8, not YAML, or not a mapping.
    """
    import yaml  # ~20 ms; only when a deploy config is given

    name = f"--deploy-config {path}"
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read it: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ConfigError(f"{name}: not valid YAML: {where}{what}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: must be a mapping with a 'stages:' list, got {type(data).__name__}")


def check_port(port: int) -> None:
    """``port`` is a TCP port number (``0``: any free one).

    Raises:
        ConfigError: ``--port <port>: must be between 0 and 65535`` (Python's ``bind`` would wrap
            70000 round to 4464 and serve there).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: must be between 0 and 65535")


def bind_listener(host: str | None, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``None`` host: every IPv4 address) for the server.

    Binds with ``SO_REUSEADDR`` as uvicorn does, so a port in ``TIME_WAIT`` is not refused, and
    listens at once (connections queue until uvicorn serves the socket); the socket is not
    inherited by child processes (:pep:`446`).

    Raises:
        ConfigError: ``--port <port>: address already in use`` (or not permitted, or a bad host).
    """
    check_port(port)
    where = f"{host or '0.0.0.0'}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, OverflowError) as exc:
        raise ConfigError(f"--host {host or '0.0.0.0'}: cannot listen on {where} ({exc})") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise ConfigError(
            f"--port {port}: cannot listen on {where}: {reason}; stop the process using it or pick "
            f"another --port"
        ) from exc
    return sock


#: The accept queue's length while the engines load (uvicorn's default; it sets its own when it serves).
LISTEN_BACKLOG = 2048

#: Sockets bound by :func:`check_bind` with ``hold=True``, by ``(host, port)`` as given.
_held: dict[tuple[str | None, int], socket.socket] = {}


def check_bind(host: str | None, port: int, *, hold: bool = False) -> None:
    """This process can listen on ``host:port`` now.

    ``hold=True`` keeps the bound socket for :func:`take_listener` (the ``serve`` command line:
    nothing else can take the port while the engines load); otherwise it is closed at once.

    Raises:
        ConfigError: as :func:`bind_listener`.
    """
    if (host, port) in _held:
        return
    sock = bind_listener(host, port)
    if hold:
        _held[(host, port)] = sock
    else:
        sock.close()


def take_listener(host: str | None, port: int) -> socket.socket:
    """The socket the server listens on: the one :func:`check_bind` holds for ``host:port``, else
    a newly bound one. Sockets held for other addresses are closed.

    Raises:
        ConfigError: as :func:`bind_listener` (when none was held).
    """
    sock = _held.pop((host, port), None)
    release_held()
    return sock if sock is not None else bind_listener(host, port)


def release_held() -> None:
    """Close every socket :func:`check_bind` holds (a command line refused after the check)."""
    while _held:
        _held.popitem()[1].close()


def _is_value(token: str) -> bool:
    """``token`` is a flag's value, not a flag: it does not start with ``-``, or is a negative number
    (argparse takes ``--port -1`` as the value ``-1``)."""
    return not token.startswith("-") or _NEGATIVE_NUMBER.fullmatch(token) is not None


_NEGATIVE_NUMBER = re.compile(r"-\d+(\.\d*)?")


def _flag_name(token: str) -> str:
    """``--dry_run=x`` -> ``--dry-run`` (argparse takes both spellings of our flags)."""
    name = token.partition("=")[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _values(argv: list[str]) -> dict[str, list[str]]:
    """The values of :data:`CHECKED_FLAGS` in ``argv`` (``--flag v``, ``--flag=v``, ``--flag_name``)."""
    found: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            break
        _, has_value, inline = token.partition("=")
        name = _flag_name(token)
        count = CHECKED_FLAGS.get(name)
        if count is None:
            continue
        if has_value:
            found.setdefault(name, []).append(inline)
            continue
        taken = 0
        while (
            i < len(argv)
            and _is_value(argv[i])
            and (count == "+" or (isinstance(count, int) and taken < count))
        ):
            found.setdefault(name, []).append(argv[i])
            i += 1
            taken += 1
    return found


def check_argv(argv: Iterable[str], *, hold: bool = False, bind: bool = True) -> None:
    """Check the start-up inputs of a ``serve`` command line (without ``serve``) as given, then
    (``bind``) its address (:func:`bind_argv`).

    Start-up adapters are local files (``--allow-remote-lora`` concerns request paths only).

    Raises:
        ConfigError: the first bad input, named as given.
    """
    argv = list(argv)
    values = _values(argv)
    for value in values.get("--lora-modules", []):
        resolve_local("--lora-modules", value, parse_lora_module(value)[1])
    for path in values.get("--lora-path", []):
        resolve_local("--lora-path", path, path)
    for path in values.get("--lora-dirs", []):
        resolve_local("--lora-dirs", path, path, directory=True)
    for path in values.get("--deploy-config", []):
        check_deploy_yaml(path)
    port = _port(values)
    if port is not None:
        check_port(port)  # also with --dry-run, which prints it
    if bind:
        bind_argv(argv, hold=hold)


def bind_argv(argv: Iterable[str], *, hold: bool = False) -> None:
    """Bind the ``--host`` / ``--port`` of a ``serve`` command line (without ``serve``);
    ``hold=True`` keeps it for the server (:func:`check_bind`). ``--dry-run`` binds nothing
    (nothing will listen); a ``--port`` that is not a number is left to the full parser.

    Raises:
        ConfigError: the port is out of range or cannot be bound.
    """
    argv = list(argv)
    if any(_flag_name(token) == "--dry-run" for token in argv):
        return
    values = _values(argv)
    port = _port(values)
    if port is not None:
        hosts = values.get("--host")
        check_bind(hosts[-1] if hosts else None, port, hold=hold)


def _port(values: dict[str, list[str]]) -> int | None:
    """The ``--port`` given last (8000 when none), ``None`` when it is not a number (the full
    parser reports it)."""
    try:
        return int(values.get("--port", ["8000"])[-1])
    except ValueError:
        return None
