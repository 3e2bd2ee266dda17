"""The public exception hierarchy of ``vllm_omni``.

Every error the package raises on purpose is one of these, so callers (the HTTP layer
included) classify failures by type, never by message text::

    OmniError
    ├── OmniUserError (also ValueError)    the input is wrong; fix the input
    │   ├── ConfigError                    an option, override, deploy YAML entry or flag
    │   │   └── ServeArgsError             ``serve``'s flags contradict each other
    │   ├── InvalidRequestError            a request's prompt, sampling params or adapters
    │   ├── InvalidAdapterError            an adapter a stage cannot serve (file, module, rank)
    │   │   ├── AdapterNotFoundError       its file or folder does not exist (also FileNotFoundError)
    │   │   ├── AdapterFileNotAllowedError a file resolves outside the allowed roots (``--lora-dirs``)
    │   │   └── LoRAFormatError            a malformed adapter file or an unsupported feature
    │   └── LoRANotEnabledError            a LoRA call on a stage without ``enable_lora``
    ├── LoRACacheError (also RuntimeError) a cache rule forbids the call (pinned, in use, full)
    └── StageEngineError (also RuntimeError)  a stage's engine failed; other requests may go on
        └── StageDeadError                 the stage's engine is gone; later requests fail too

The HTTP layer's own answers are not ``OmniError`` s: :class:`OpenAIError` (an answer with a status
and an OpenAI-style body), :class:`ClientDisconnected` (the client left; its request was
cancelled) and :class:`BodyTooLargeError` (a request body over the size limit, while it is read);
``vllm_omni/entrypoints/openai/errors.py`` maps every error to its answer.

User errors subclass ``ValueError`` as vLLM's own input errors do, so code that catches
``ValueError`` around ``vllm.LLM`` keeps working around :class:`vllm_omni.Omni`.
Messages name the culprit: the stage (``stage 0 (llm_ar)``), the key or option, the file
or the module, and where it helps, the knob to turn.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterable

__all__ = [
    "AdapterFileNotAllowedError",
    "AdapterNotFoundError",
    "BodyTooLargeError",
    "ClientDisconnected",
    "ConfigError",
    "InvalidAdapterError",
    "InvalidRequestError",
    "LoRACacheError",
    "LoRAFormatError",
    "LoRANotEnabledError",
    "OmniError",
    "OmniUserError",
    "OpenAIError",
    "ServeArgsError",
    "StageDeadError",
    "StageEngineError",
]


class OmniError(Exception):
    """Base class of every error ``vllm_omni`` raises on purpose."""


class OmniUserError(OmniError, ValueError):
    """The caller's input is wrong (HTTP: 400). The message says which input and why.

    Attributes:
        param: the request field at fault, when the raiser knows it (the HTTP error body's ``param``).
    """

    param: str | None = None


class ConfigError(OmniUserError):
    """A configuration value is wrong: an option, a stage override, a deploy YAML entry or a CLI flag.

    Attributes:
        options: the option names the error is about, when the raiser knows them (``()``
            otherwise); the resolver uses them to name the input each value came from.
    """

    def __init__(self, *args: object, options: tuple[str, ...] | list[str] = ()) -> None:
        super().__init__(*args)
        self.options = tuple(options)


class ServeArgsError(ConfigError):
    """``serve``'s command line is inconsistent (reported before anything loads)."""


class InvalidRequestError(OmniUserError):
    """A request is refused before it runs: prompt, sampling parameters or its adapter list."""


class InvalidAdapterError(OmniUserError):
    """An adapter that a stage cannot serve; the message names the adapter and the reason."""


class AdapterRestoreError(InvalidAdapterError):
    """An adapter a stage held could not be loaded again when the stage's worker restarted (its
    files deleted or unreadable); the stage serves its other adapters and refuses requests
    naming this one (HTTP 400). The message names the stage, the adapter and its path."""


class AdapterUpdateRefusedError(InvalidAdapterError):
    """A new version of a registered adapter (a reload, ``load_inplace``, rewritten files) found no room
    in a stage's adapter cache (every entry pinned or in use); nothing changed and the current version
    keeps serving (HTTP 400). The message names the adapter, the stage and the limits to raise."""


class AdapterNotFoundError(InvalidAdapterError, FileNotFoundError):
    """An adapter's file or folder does not exist (also a ``FileNotFoundError``); the message names the adapter."""


class AdapterFileNotAllowedError(InvalidAdapterError):
    """An adapter file resolves outside the server's allowed roots (``--lora-dirs``; HTTP 400); the
    message names the file as given (:mod:`vllm_omni.lora.allow_list`)."""


class LoRAFormatError(InvalidAdapterError):
    """An adapter file or directory is malformed or uses a feature this runtime does not support."""


class LoRANotEnabledError(OmniUserError):
    """A LoRA call reached a stage whose config has no ``enable_lora`` (or no LoRA options)."""


class LoRACacheError(OmniError, RuntimeError):
    """A cache rule forbids the operation (every entry pinned or in use, adapter in use, ...)."""


class StageEngineError(OmniError, RuntimeError):
    """A stage's engine failed on a request; the message names the stage."""


class StageDeadError(StageEngineError):
    """A stage's engine (or one of its worker processes) is gone; the stage serves no more requests."""


class OpenAIError(Exception):
    """An error answered to an HTTP client with ``status`` and an OpenAI-style body
    (``param``: the request field at fault, if any)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready; its request was cancelled.

    Answered with an empty ``499`` (nginx's "client closed request") that nobody reads; not logged.
    """


class BodyTooLargeError(Exception):
    """A request body grew past the server's limit while it was read (answered ``413``)."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` naming the closest of ``candidates`` to ``name``, or ``""``."""
    match = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.75)
    return f" (did you mean {match[0]!r}?)" if match else ""


def restate(exc: OmniError, prefix: str) -> OmniError:
    """A copy of ``exc`` (same class, same attributes such as ``options``) whose message is
    ``"<prefix>: <message>"``: for adding where an error happened (the stage) without turning a
    user error into an engine error. Raise it ``from exc``."""
    new = copy.copy(exc)
    new.args = (f"{prefix}: {exc}",)
    return new
