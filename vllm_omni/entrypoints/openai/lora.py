"""The ``lora`` request field: parsing, the adapter-path allow-list, and the server's view of the adapter registry.

``lora`` is an object or a list of objects with the keys

- ``name`` (or ``lora_name``, ``adapter``): adapter name; optional when ``path`` is given;
- ``path`` (or ``local_path``): a PEFT directory or one ``.safetensors`` file;
- ``scale`` (or ``lora_scale``, ``strength``, ``weight``): per-request weight (diffusion stages;
  LLM stages take 1.0 only). Unset means 1.0, or the stage's ``--lora-scale`` for a ``--lora-path``
  adapter. On diffusion stages it may also be a list with one value per denoising step, a list of
  step-fraction ranges ``{"start", "end", "scale"}``, or ``{"steps": <number | list>, "blocks":
  {<pattern or block index>:
  <multiplier>}}`` (:mod:`vllm_omni.lora.schedule`);
- ``int_id``: optional adapter id; by default a stable function of the path
  (:func:`~vllm_omni.lora.request.stable_lora_int_id`), so the same name with another
  path is another adapter and never reuses the old weights (the engine's registry versions every
  adapter by its content as well: :mod:`vllm_omni.lora.registry`).
- ``stage``: optional stage id (per-stage request adapters, an opt-in extension); unset is the
  entry stage, as before. A later stage must be an LLM stage with LoRA enabled, and takes one
  adapter at scale 1.0; otherwise the request is refused before it starts.
- ``denoiser``: on a two-denoiser diffusion stage (Wan2.2 MoE), the denoiser the adapter acts on:
  ``"transformer"`` / ``"high_noise"`` or ``"transformer_2"`` / ``"low_noise"``; unset follows
  :func:`~vllm_omni.lora.request.assign_denoisers` (``[high_noise, low_noise]`` by position).
- ``text_encoder_scale`` (or ``strength_clip``, ComfyUI's "clip strength"): on a diffusion stage, the
  weight of the adapter's text-encoder parts (a number; unset: its ``scale``); checked with the other
  request-adapter rules (:func:`~vllm_omni.lora.request.validate_request_adapters`).

Two spellings of one field in one object are refused, and so is any other key (the message names the
nearest allowed key). A bare ``{"name": ...}`` selects an adapter the engine's registry knows
(``--lora-modules``, ``/v1/load_lora_adapter``, ``--lora-path`` or ``AsyncOmni.add_lora``).

Paths in requests are served only when they are inside a ``--lora-dirs`` root after
``realpath`` (so ``..`` and symlinks leading out are refused) or were registered at
start-up; every file read for such an adapter (``adapter_config.json``, the weights) must resolve
inside a root as well, at every read: registration, reloads (``load_inplace``, a request finding the
files changed) and worker restarts check again (:mod:`vllm_omni.lora.allow_list`), so an adapter folder
later replaced by a symlink leading out is refused, naming it; the loaded version stays registered.
Remote locations (URLs, hub ids) only with ``--allow-remote-lora``. A refusal
says the same thing whether or not the target exists. Pickle-only adapters are refused.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from huggingface_hub import snapshot_download

from vllm_omni.entrypoints.openai.errors import bad_request, not_found
from vllm_omni.errors import InvalidAdapterError, InvalidRequestError, OpenAIError
from vllm_omni.lora.adapter_files import AdapterFiles, locate_adapter
from vllm_omni.lora.allow_list import AdapterFileAllowList
from vllm_omni.lora.registry import AdapterRegistry
from vllm_omni.lora.request import LoRARequest, canonical_denoiser, stable_lora_int_id
from vllm_omni.lora.schedule import LoRAScaleSchedule, coerce_scale

#: Each field and the spellings accepted for it (the first is the canonical one): ``lora_scale`` and
#: ``adapter`` as the vllm-omni project writes them, ``lora_name`` / ``local_path`` as vLLM's
#: ``/v1/load_lora_adapter`` does, ``strength`` / ``weight`` as ComfyUI and A1111 call a LoRA's scale.
FIELD_SPELLINGS: dict[str, tuple[str, ...]] = {
    "name": ("name", "lora_name", "adapter"),
    "path": ("path", "local_path"),
    "scale": ("scale", "lora_scale", "strength", "weight"),
    "int_id": ("int_id",),
    "stage": ("stage",),
    "denoiser": ("denoiser",),
    "text_encoder_scale": ("text_encoder_scale", "strength_clip"),
}
ALLOWED_KEYS = tuple(key for spellings in FIELD_SPELLINGS.values() for key in spellings)
MAX_STAGE_ID = 1023
MAX_NAME_LEN = 256
MAX_PATH_LEN = 4096
MAX_ITEMS = 16  # hard cap before any per-pipeline limit
_INT_ID_MAX = 2**31 - 1
#: An A1111 extra-network token in a prompt: ``<lora:name>`` or ``<lora:name:weight>``.
PROMPT_LORA_TOKEN = re.compile(r"<lora:([^:<>]*)(?::([^<>]*))?>")
_TOKEN_WITH_SPACES = re.compile(r"\s*" + PROMPT_LORA_TOKEN.pattern + r"\s*")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRASpec:
    """One parsed entry of the ``lora`` field (not yet checked against the server)."""

    name: str | None
    path: str | None
    scale: float | LoRAScaleSchedule | None = None  # None: the default (1.0, or the stage's lora_scale)
    int_id: int | None = None
    stage: int | None = None  # None: the entry stage
    denoiser: str | None = None  # None: by the request's position rule (two-denoiser stages)
    text_encoder_scale: Any = None  # None: the scale; checked by validate_request_adapters


def _canonical_fields(entry: dict, where: str) -> dict[str, Any]:
    """``entry`` with every key in its canonical spelling (:data:`FIELD_SPELLINGS`).

    Raises:
        OpenAIError: (400) an unknown key (naming the nearest allowed key), or two spellings of one field.
    """
    unknown = sorted(str(k) for k in entry if k not in ALLOWED_KEYS)
    if unknown:
        hints = []
        for key in unknown:
            near = difflib.get_close_matches(key.lower(), ALLOWED_KEYS, n=1, cutoff=0.6)
            hints.append(f"{key!r} (did you mean {near[0]!r}?)" if near else repr(key))
        raise bad_request(
            f"{where} has unknown key(s) {', '.join(hints)}; allowed keys: {list(ALLOWED_KEYS)}", "lora"
        )
    fields: dict[str, Any] = {}
    for field, spellings in FIELD_SPELLINGS.items():
        present = [k for k in spellings if k in entry]
        if len(present) > 1:
            raise bad_request(
                f"{where}: {' and '.join(repr(k) for k in present)} are spellings of the same field "
                f"{field!r}; give only one",
                "lora",
            )
        if present:
            fields[field] = entry[present[0]]
    return fields


def _parse_entry(entry: Any, where: str) -> LoRASpec:
    if not isinstance(entry, dict):
        raise bad_request(f"{where} must be an object, got {type(entry).__name__}", "lora")
    entry = _canonical_fields(entry, where)
    name = entry.get("name")
    path = entry.get("path")
    if name is not None and (not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LEN):
        raise bad_request(
            f"{where}.name must be a non-empty string of at most {MAX_NAME_LEN} characters", "lora"
        )
    if path is not None and (
        not isinstance(path, str) or not path.strip() or len(path) > MAX_PATH_LEN or "\x00" in path
    ):
        raise bad_request(f"{where}.path must be a non-empty path string", "lora")
    if name is None and path is None:
        raise bad_request(
            f"{where} needs 'path' (or 'local_path'), or the 'name' of a loaded adapter", "lora"
        )
    try:
        scale = coerce_scale(entry.get("scale"), f"{where}.scale")
    except InvalidRequestError as exc:
        raise bad_request(f"{exc} (LoRA {name or path!r:.300})", "lora") from None
    int_id = entry.get("int_id")
    if int_id is not None and (
        isinstance(int_id, bool) or not isinstance(int_id, int) or not 1 <= int_id <= _INT_ID_MAX
    ):
        raise bad_request(f"{where}.int_id must be an integer in [1, {_INT_ID_MAX}]", "lora")
    stage = entry.get("stage")
    if stage is not None and (
        isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= MAX_STAGE_ID
    ):
        raise bad_request(f"{where}.stage must be a stage id (an integer in [0, {MAX_STAGE_ID}])", "lora")
    try:
        denoiser = canonical_denoiser(entry.get("denoiser"), f"{where}.denoiser")
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "lora") from None
    te_scale = entry.get("text_encoder_scale")
    return LoRASpec(name, path, scale, int_id, stage, denoiser, te_scale)


def parse_lora_field(value: Any, max_items: int = MAX_ITEMS) -> list[LoRASpec]:
    """Parse the raw ``lora`` value of a request body.

    Returns:
        The entries in order (``[]`` for ``None`` or an empty list).

    Raises:
        OpenAIError: (400) wrong types, unknown keys, bad scales or ids, too many entries.
    """
    if value is None:
        return []
    if isinstance(value, dict):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise bad_request(f"lora must be an object or a list of objects, got {type(value).__name__}", "lora")
    limit = min(max_items, MAX_ITEMS)
    if len(items) > limit:
        raise bad_request(
            f"too many adapters in lora: {len(items)}; this pipeline applies at most {limit} per request "
            "(a diffusion stage's max_loras: start the server with --max-loras N to allow N; an LLM stage "
            "applies one)",
            "lora",
        )
    specs = [
        _parse_entry(item, f"lora[{i}]" if isinstance(value, list) else "lora")
        for i, item in enumerate(items)
    ]
    return specs


def prompt_lora_syntax(prompt: Any, lora: Any, enabled: bool) -> tuple[Any, Any]:
    """A1111's ``<lora:name:weight>`` tokens in an image prompt (``--prompt-lora-syntax``).

    Enabled, each token selects the registered adapter ``name`` at scale ``weight`` (default 1.0) and is
    removed from the text (it and the whitespace around it become one space): the result is the ``lora`` field with one
    ``{"name": name, "scale": weight}`` entry per token after the body's own entries. Disabled, the
    prompt and field are returned unchanged and a prompt holding a token gets one log warning naming
    the option. Anything but a string prompt is returned unchanged.

    Returns:
        ``(prompt, lora)`` to use.

    Raises:
        OpenAIError: (400, ``prompt``) a token without a name or with a weight that is not a number.
    """
    if not isinstance(prompt, str) or "<lora:" not in prompt:
        return prompt, lora
    tokens = PROMPT_LORA_TOKEN.findall(prompt)
    if not tokens:
        return prompt, lora
    if not enabled:
        logger.warning(
            "the prompt holds %d A1111 LoRA token(s) (e.g. '<lora:%s:...>'); they are sent to the model as "
            "text: start the server with --prompt-lora-syntax to select adapters with them, or use the "
            "'lora' field",
            len(tokens),
            tokens[0][0][:64],
        )
        return prompt, lora
    entries = []
    for name, weight in tokens:
        token = f"<lora:{name}{':' + weight if weight else ''}>"
        if not name.strip():
            raise bad_request(f"prompt: {token!r:.120} names no adapter", "prompt")
        try:
            scale = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise bad_request(f"prompt: {token!r:.120}: the weight must be a number", "prompt") from None
        entries.append({"name": name.strip(), "scale": scale})
    own = [] if lora is None else lora if isinstance(lora, list) else [lora]
    return _TOKEN_WITH_SPACES.sub(" ", prompt).strip(), [*own, *entries]


def is_remote(path: str) -> bool:
    """URLs and hub ids (``org/name``): anything that is not an absolute local path."""
    return "://" in path or not os.path.isabs(path)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class ServerAdapters:
    """The server's view of the engine's adapter registry, and the rules for request paths.

    The adapters themselves (names, ids, versions, where they are loaded) live in the engine's
    :class:`~vllm_omni.lora.registry.AdapterRegistry` (``AsyncOmni.adapter_registry``), whatever added
    them (``--lora-modules``, ``/v1/load_lora_adapter``, ``AsyncOmni.add_lora`` from Python); this class
    adds only what is the server's own: the ``--lora-dirs`` allow-list, the served model's names (reserved
    in the registry) and the ``lora`` field's forms.

    Args:
        registry: the engine's adapter registry.
        lora_dirs: roots whose adapters requests may name by path.
        allow_remote: accept hub ids / URLs in requests.
        base_names: names of the base model (``model`` values that select no adapter).
    """

    def __init__(
        self, registry: AdapterRegistry, lora_dirs: list[str], allow_remote: bool, base_names: list[str]
    ):
        self.core = registry
        self.roots = [os.path.realpath(d) for d in lora_dirs]
        self.allow_remote = allow_remote
        self.base_names = list(base_names)
        self.startup_paths: set[str] = set()
        # checked again at every read of an adapter's files (reloads, restarts), not only here
        self.allow_list = AdapterFileAllowList(self.roots)
        registry.set_file_check(self.allow_list.check_read)
        registry.reserve_names(self.base_names, "a name of the served model; choose another adapter name")

    @property
    def named(self) -> dict[str, LoRARequest]:
        """``{name: LoRARequest(name, int_id, path)}`` of every registered adapter (a view, in registration order)."""
        return {record.name: record.request for record in self.core.records()}

    # ------------------------------------------------------------ registration
    def register_startup_path(self, path: str) -> str:
        real = os.path.realpath(path)
        self.startup_paths.add(real)
        self.allow_list.trust(real)
        return real

    def name_clash(self, name: str, *, replace: bool = False) -> str | None:
        """Why ``name`` cannot name an adapter (``None`` when it can): the one rule of every way an
        adapter gets a name (``--lora-path``, ``--lora-modules``, ``/v1/load_lora_adapter``).

        A name is one namespace with the served model's names; ``replace`` lets a loaded
        adapter's name be reused (``load_inplace``).
        """
        if name in self.base_names:
            return f"'{name}' is a name of the served model; choose another adapter name"
        if self.core.get(name) is not None and not replace:
            return f"The lora adapter '{name}' has already been loaded."
        return None

    # ------------------------------------------------------------ paths
    def _refused(self, path: str) -> OpenAIError:
        # Same words whether the target exists or not.
        return bad_request(
            f"adapter path {path!r} is not allowed: request paths must lie inside one of the server's "
            f"--lora-dirs roots or be registered at start-up",
            "lora",
        )

    def new_adapter_id(self, name: str, location: str) -> int:
        """The id an adapter registered as ``name`` at ``location`` gets: the path's stable id, unless
        another registered name holds it (the same files under a second name, which vLLM serves as a
        second adapter), then one derived from the path and the name."""
        int_id = stable_lora_int_id(location)
        held = self.core.by_id(int_id)
        if held is not None and held.registered and held.name != name:
            return stable_lora_int_id(f"{location}#{name}")
        return int_id

    def resolve_path(self, path: str) -> str:
        """Check ``path`` against the allow-list; return the location to load.

        Raises:
            OpenAIError: (400) refused, missing, or a pickle-only / non-safetensors adapter.
        """
        if is_remote(path):
            if not self.allow_remote:
                raise bad_request(
                    "remote adapter locations (URLs, hub ids, relative paths) are disabled on this server; "
                    "use an absolute path inside --lora-dirs (or start it with --allow-remote-lora)",
                    "lora",
                )
            return self.allow_list.trust(self._fetch_remote(path))  # a snapshot the server fetched itself
        real = os.path.realpath(path)
        if real not in self.startup_paths and not any(_inside(real, root) for root in self.roots):
            raise self._refused(path)
        files = check_adapter_files(real, path)
        if real not in self.startup_paths:
            self._check_files_inside(files, path)
        return real

    def _check_files_inside(self, files: AdapterFiles, path: str) -> None:
        """Every file the adapter is read from (weights and config) must resolve inside a root too:
        a symlink in an allowed folder must not lead the server to open a file outside it.

        Raises:
            OpenAIError: (400) naming the file (as the client would see it) that leads outside.
        """
        for opened in (files.weights, files.config):
            if opened is None:
                continue
            resolved = os.path.realpath(opened)
            if not any(_inside(resolved, root) for root in self.roots):
                folder = path if files.is_directory else os.path.dirname(path)
                shown = path if opened == files.weights and not files.is_directory else None
                shown = shown or os.path.join(folder, os.path.basename(opened))
                raise bad_request(
                    f"adapter file {shown!r} is not allowed: it resolves outside the server's --lora-dirs "
                    f"roots (every file of a request adapter must lie inside them)",
                    "lora",
                )

    @staticmethod
    def _fetch_remote(path: str) -> str:
        """Download a hub adapter (safetensors + config only); URLs are not fetched."""
        if "://" in path and not path.startswith("hf://"):
            raise bad_request(
                f"cannot fetch adapter {path!r}: only hub ids (org/name or hf://org/name)", "lora"
            )
        repo = path.removeprefix("hf://")
        try:
            local = snapshot_download(repo, allow_patterns=["adapter_config.json", "*.safetensors"])
        except Exception as exc:
            raise bad_request(f"cannot fetch adapter {path!r}: {type(exc).__name__}", "lora") from exc
        check_adapter_files(local, path)
        return local

    # ------------------------------------------------------------ requests
    def lookup(self, name: str) -> LoRARequest:
        """The registered adapter called ``name`` (public form).

        Raises:
            OpenAIError: 404 when no adapter has that name.
        """
        record = self.core.get(name)
        if record is None:
            raise not_found(f"The adapter `{name}` does not exist (not loaded on this server).", "lora")
        return record.request

    def to_request(self, spec: LoRASpec) -> LoRARequest:
        """Turn one parsed entry into a ``LoRARequest`` (public form; the engine's registry versions it).

        A path without a name is named after the adapter registered at that path (whose id it then takes),
        else the path as given; the name is what the reply's ``model`` field says.

        Raises:
            OpenAIError: 404 for an unknown bare name; 400 for a refused/invalid path, or an ``int_id``
                other than the named adapter's.
        """
        if spec.path is None:
            known = self.lookup(spec.name)
            if spec.int_id is not None and spec.int_id != known.lora_int_id:
                raise bad_request(
                    f"lora: adapter {spec.name!r} has id {known.lora_int_id}, not {spec.int_id}"
                )
            return known
        location = self.resolve_path(spec.path)
        if spec.name is not None:
            self._check_request_name(spec.name, location)
        registered = None
        if spec.int_id is None:  # the path of a registered adapter selects that adapter
            registered = next((r for r in self.core.records() if r.location == location), None)
        int_id = spec.int_id or (registered.int_id if registered else stable_lora_int_id(location))
        record = self.core.by_id(int_id)
        if record is not None and record.location != location:
            raise bad_request(
                f"lora: int_id {int_id} already names another adapter on this server; "
                f"omit int_id to get the path's own id",
                "lora",
            )
        named = registered or (record if record is not None and record.registered else None)
        return LoRARequest(spec.name or (named.name if named else spec.path), int_id, location)

    def _check_request_name(self, name: str, location: str) -> None:
        """A request's ``name`` beside a ``path`` must not take a served name or another adapter's."""
        if name in self.base_names:
            raise bad_request(f"lora: {self.name_clash(name)}", "lora")
        known = self.core.get(name)
        if known is not None and known.location != location:
            raise bad_request(
                f"lora: the name {name!r} belongs to a loaded adapter at another path; "
                f"omit 'name', choose another, or pass only the name to use that adapter",
                "lora",
            )


def check_adapter_files(location: str, shown: str) -> AdapterFiles:
    """Refuse anything that is not a safetensors adapter (file or PEFT directory); see
    :func:`vllm_omni.lora.adapter_files.locate_adapter`, whose :class:`AdapterFiles` it returns. Nothing is read.

    The message names the path as the client gave it (``shown``), never the resolved one.

    Raises:
        OpenAIError: (400) missing, pickle, or not a safetensors adapter.
    """
    try:
        return locate_adapter(location, shown=f"adapter {shown!r}")
    except FileNotFoundError:
        raise bad_request(f"adapter {shown!r} was not found", "lora") from None
    except InvalidAdapterError as exc:
        raise bad_request(str(exc), "lora") from None
