"""``serve`` command-line mistakes told from the flags and the files they name, before vLLM.

:func:`check` runs on the raw command line (:func:`vllm_omni.entrypoints.cli.fast.try_fast`),
before anything heavy is imported, and refuses with one message that names the flag or file and
the fix:

* a value of the wrong kind or outside its choices (``--max-lora-rank abc``, ``--dtype fp8x``):
  our own flags always, vLLM's from the command-line cache once it is warm;
* ``--stage-overrides`` that is not a JSON object, or (once the cache is warm) names an option no
  stage takes; a numeric flag out of its range (``--lora-scale 500``); a value holding a control
  character; upstream vllm-omni's ``--stage-configs-path`` (pointed to ``--deploy-config``);
* a local model path that does not exist, is a file, or is a folder that holds neither
  ``config.json`` nor ``model_index.json`` (or holds one that is not JSON);
* on a one-stage LLM model (a ``...ForCausalLM`` with the default pipeline): ``--lora-modules``
  without ``--enable-lora``,
  and a start-up adapter whose rank (``adapter_config.json``: ``r``, ``rank_pattern``) is above
  ``--max-lora-rank`` (vLLM's default when the flag is not given);
* a ``--lora-modules`` / ``--lora-path`` folder that is a model, not an adapter, a weights file
  whose tensors are a model's (no adapter key: a base checkpoint given as an adapter), an
  ``adapter_config.json`` that is not a JSON object, a weights file without a safetensors header
  that declares a tensor;
* and :func:`~vllm_omni.entrypoints.cli.preflight.check_argv`'s checks of the adapter, folder
  and deploy files and of the port (before the LoRA checks: a missing file is named first).

A command line this module cannot read for sure (a flag it does not know, a deploy YAML or a
named pipeline that may change a stage) is never refused here: the full parser and the typed
config check it a few seconds later, still before any engine starts.

Only the standard library, :mod:`vllm_omni.errors` and the stdlib-only preflight module are imported here.
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm_omni.entrypoints.cli.preflight import check_argv, parse_lora_module
from vllm_omni.errors import ConfigError, did_you_mean

#: vLLM's ``--max-lora-rank`` default (``EngineArgs.max_lora_rank``); the cache records the
#: installed vLLM's own value, this is used only before the cache is written.
DEFAULT_MAX_LORA_RANK = 16
_KIND_WORDS = {"int": "an integer", "float": "a number"}


class Scan:
    """A ``serve`` command line (without ``serve``) read with a table of value kinds.

    Attributes:
        positionals: the words that are no flag's value.
        values: ``{"--flag": [value, ...]}`` (``--flag_name`` and ``--flag=value`` spellings
            folded); a flag that takes no value maps to ``[]``.
    """

    def __init__(self, argv: list[str], kinds: dict[str, Any]):
        self.positionals: list[str] = []
        self.values: dict[str, list[str]] = {}
        i = 0
        while i < len(argv):
            token = argv[i]
            i += 1
            if token == "--":
                self.positionals += argv[i:]
                break
            if not token.startswith("--"):
                self.positionals.append(token)
                continue
            name, has_value, inline = token.partition("=")
            name = "--" + name[2:].replace("_", "-")
            taken = self.values.setdefault(name, [])
            if has_value:
                taken.append(inline)
                continue
            kind = kinds.get(name, 1)  # an unknown flag: its next word, if any, is taken as its value
            while i < len(argv) and kind != 0 and _is_value(argv[i]):
                taken.append(argv[i])
                i += 1
                if kind == 1:
                    break

    def last(self, flag: str) -> str | None:
        """The value given last to ``flag`` (``None`` when absent or without a value)."""
        given = self.values.get(flag)
        return given[-1] if given else None

    @property
    def model(self) -> str | None:
        return self.last("--model") or (self.positionals[0] if self.positionals else None)


def _is_value(token: str) -> bool:
    return not token.startswith("-") or token[1:2].isdigit()


def check(
    argv: list[str], kinds: dict[str, Any], rules: dict[str, dict[str, Any]], defaults: dict[str, Any]
) -> None:
    """Refuse a ``serve`` command line (without ``serve``) whose flags or files are wrong.

    Args:
        kinds: ``{"--flag": 0 | 1 | "*"}`` how many values each known flag takes.
        rules: ``{"--flag": {"type": "int", "choices": [...]}}`` (:func:`fast.value_rules`).
        defaults: vLLM's defaults this module needs (``{"max_lora_rank": 16}``).

    Raises:
        ConfigError: the first mistake, naming the flag or file and the fix.
    """
    scan = Scan(argv, kinds)
    for flag in scan.values:
        if flag in RENAMED_FLAGS:
            raise ConfigError(RENAMED_FLAGS[flag])
    for flag, values in scan.values.items():
        rule = rules.get(flag)
        for value in values:
            if rule is not None:
                _check_value(flag, value, rule)
            if flag in RANGES:
                _check_range(flag, value)
            _check_text(flag, value)
    for value in scan.positionals:
        _check_text("model", value)
    overrides = _stage_overrides(scan.last("--stage-overrides"))
    _check_override_keys(overrides, defaults.get("stage_keys"))
    kind = _model_kind(scan.model) if scan.model is not None else None
    check_argv(argv, bind=False)  # adapter, folder and deploy files exist and can be read; the port
    for flag, value, path in _startup_adapters(scan):
        _check_not_a_model(flag, value, path)
        _check_adapter_files(flag, value, path)
    plain = kind == "llm" and "--pipeline" not in scan.values and "--deploy-config" not in scan.values
    if plain and "0" not in overrides:  # one LLM stage, configured by these flags only
        _check_llm_lora(scan, defaults)


#: Flags of upstream vllm-omni this command does not take, and what to use instead.
RENAMED_FLAGS = {
    "--stage-configs-path": (
        "--stage-configs-path is upstream vllm-omni's flag; here a stage layout YAML is a deploy "
        "config: pass it with --deploy-config <file> (docs/user_guide/deployment.md), or set one "
        "stage's options with --stage-overrides '{\"0\": {...}}'"
    ),
}

#: ``(lowest, highest)`` of numeric flags (``None``: unbounded); ``--lora-scale`` is the adapter
#: scale bound of the diffusion config and of requests (``vllm_omni.lora.schedule.MAX_ADAPTER_SCALE``).
RANGES: dict[str, tuple[float | None, float | None]] = {
    "--lora-scale": (-100.0, 100.0),
    "--max-lora-rank": (1, None),
    "--max-loras": (1, None),
    "--max-cpu-loras": (1, None),
}

#: The longest value a flag takes (a path's ``PATH_MAX``; JSON flags may be longer).
MAX_FLAG_CHARS = 4096
_JSON_FLAGS = ("--stage-overrides", "--lora-modules")


def _check_text(flag: str, value: str) -> None:
    """A flag's value holds no control character (a stray escape or newline pasted into a path) and
    is of a sensible length (JSON flags excepted)."""
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None and not (flag in _JSON_FLAGS and bad in "\t\n\r"):
        raise ConfigError(
            f"{flag} {value!r}: holds the control character U+{ord(bad):04X} at position {value.index(bad)}; "
            "retype the value without it"
        )
    if len(value) > MAX_FLAG_CHARS and flag not in _JSON_FLAGS:
        raise ConfigError(f"{flag}: a value of {len(value)} characters, more than {MAX_FLAG_CHARS}")


def _check_range(flag: str, value: str) -> None:
    import math

    try:
        number = float(value)
    except ValueError:
        return  # not a number: the kind check (or the full parser) names it
    low, high = RANGES[flag]
    if (
        not math.isfinite(number)
        or (low is not None and number < low)
        or (high is not None and number > high)
    ):
        bounds = (
            f"between {low:g} and {high:g}"
            if low is not None and high is not None
            else f"at least {low:g}"
            if low is not None
            else f"at most {high:g}"
        )
        raise ConfigError(f"argument {flag}: {value} is out of range: give a finite number {bounds}")


def _check_override_keys(overrides: dict[str, Any], known: list[str] | None) -> None:
    """Every option key of ``--stage-overrides`` is one some stage takes (``known``: the cached
    union of every stage type's options; ``None`` before the cache is written: left to the config
    check). A key one stage type takes but not the stage it lands on is left to that check."""
    if not known:
        return
    for stage, options in overrides.items():
        if not isinstance(options, dict):
            continue  # the typed config names it
        for key in options:
            if str(key) not in known:
                raise ConfigError(
                    f"--stage-overrides, stage {stage}: unknown option {key!r}{did_you_mean(str(key), known)}; "
                    "options are vLLM engine arguments in snake_case (e.g. max_lora_rank) or stage keys"
                )


def _check_value(flag: str, value: str, rule: dict[str, Any]) -> None:
    kind, choices = rule.get("type", "str"), rule.get("choices")
    converted: Any = value
    if kind in _KIND_WORDS:
        try:
            converted = int(value) if kind == "int" else float(value)
        except ValueError:
            example = f" (e.g. {flag} {choices[len(choices) // 2]})" if choices else ""
            raise ConfigError(
                f"argument {flag}: invalid {kind} value {value!r}: give {_KIND_WORDS[kind]}{example}"
            ) from None
    if choices is not None and converted not in choices:
        shown = ", ".join(map(str, choices))
        raise ConfigError(f"argument {flag}: invalid choice {value!r}: choose from {shown}")


def _stage_overrides(value: str | None) -> dict[str, Any]:
    """``--stage-overrides`` parsed as far as JSON tells (worded as the typed config words it;
    stage ids and options are checked there)."""
    if value is None:
        return {}
    example = '\'{"0": {"enable_lora": true}}\''
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--stage-overrides is not valid JSON ({exc.msg} at position {exc.pos}): {value!r}; "
            f"quote names and strings with double quotes, e.g. {example}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"--stage-overrides must be an object keyed by stage id, e.g. {example}; "
            f"got {type(data).__name__}: {data!r}"
        )
    return {str(k).strip(): v for k, v in data.items()}


def _looks_local(model: str) -> bool:
    """As the pipeline registry reads a model name: a path (not a hub id ``org/name``)."""
    return (
        os.path.isabs(model) or model.startswith((".", "~")) or os.path.exists(model) or model.count("/") > 1
    )


def _model_kind(model: str) -> str | None:
    """``"llm"`` (``config.json`` of a ``...ForCausalLM``: one LLM stage), ``"other"`` (another
    ``config.json``), ``"diffusion"`` (``model_index.json``), or ``None`` (a hub id).

    Raises:
        ConfigError: a local path that is missing, a file, or not a model folder.
    """
    if not _looks_local(model):
        return None
    path = os.path.expanduser(model)
    where = f"model {model}"
    if not os.path.exists(path):
        raise ConfigError(
            f"{where}: no such directory ({os.path.abspath(path)}); pass the folder of a model "
            "(it holds config.json or model_index.json)"
        )
    if not os.path.isdir(path):
        raise ConfigError(f"{where}: is a file, not a model folder; pass the folder that holds it")
    for name, kind in (("model_index.json", "diffusion"), ("config.json", "llm")):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"{where}: {name} cannot be read as JSON ({exc}); fix or replace the file"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: {name} must hold a JSON object, got {type(data).__name__}")
        architectures = data.get("architectures") or [""]
        if kind == "llm" and not str(architectures[0]).endswith("ForCausalLM"):
            return "other"  # e.g. an omni checkpoint: the registry may give it a multi-stage pipeline
        return kind
    raise ConfigError(
        f"{where}: holds neither config.json (transformers model) nor model_index.json (diffusers "
        "pipeline); pass the model's own folder, or --pipeline <name> for a registered pipeline"
    )


def _check_not_a_model(flag: str, value: str, path: str) -> None:
    """A start-up adapter folder that is a model folder (its ``config.json``, no adapter files)."""
    path = os.path.expanduser(path)
    if not path or not os.path.isdir(path) or os.path.exists(os.path.join(path, "adapter_config.json")):
        return
    if any(os.path.exists(os.path.join(path, n)) for n in ("config.json", "model_index.json")):
        raise ConfigError(
            f"{flag} {value}: is a model folder, not a LoRA adapter; pass the folder peft's "
            "save_pretrained wrote (adapter_config.json and adapter_model.safetensors)"
        )


def _startup_adapters(scan: Scan) -> list[tuple[str, str, str]]:
    """``(flag, value as given, local path)`` of every ``--lora-modules`` / ``--lora-path`` adapter."""
    out = [("--lora-modules", v, parse_lora_module(v)[1]) for v in scan.values.get("--lora-modules", [])]
    return out + [("--lora-path", v, v) for v in scan.values.get("--lora-path", [])]


#: A safetensors header larger than this is not one (the format's own readers refuse 100 MB).
_MAX_HEADER = 100 * 1024 * 1024


def _check_adapter_files(flag: str, value: str, path: str) -> None:
    """What a read of the adapter's small files tells: ``adapter_config.json`` is a JSON object, and
    the weights file starts with a safetensors header that declares a tensor (the tensors and peft's
    rules for the config are checked later, before any engine starts)."""
    path = os.path.expanduser(path)
    config = os.path.join(path, "adapter_config.json")
    weights = os.path.join(path, "adapter_model.safetensors") if os.path.isdir(path) else path
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{flag} {value}: adapter_config.json cannot be read as JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{flag} {value}: adapter_config.json must hold a JSON object")
    if weights.endswith(".safetensors") and os.path.isfile(weights):
        why = _safetensors_header_problem(weights)
        if why is not None:
            raise ConfigError(
                f"{flag} {value}: {os.path.basename(weights)} is not a safetensors file ({why}); save the "
                "adapter again (peft's save_pretrained writes adapter_model.safetensors)"
            )
        base = _model_weights_key(weights)
        if base is not None:
            raise ConfigError(
                f"{flag} {value}: {os.path.basename(weights)} holds model weights, not a LoRA adapter (no "
                f"lora_A / lora_B / lora_down / lora_up key; e.g. {base!r}); pass the adapter peft's "
                "save_pretrained or your trainer wrote, not the base model's checkpoint"
            )


#: Parts of a tensor name that only adapter files hold (LoRA, LoHa, LoKr, DoRA, OFT, full deltas)
_ADAPTER_KEY_MARKS = ("lora", "hada_", "lokr_", "dora_", "oft", "diff", "alpha")


def _model_weights_key(path: str) -> str | None:
    """A tensor name of ``path`` when none of its names is an adapter's (a model checkpoint), else
    ``None`` (an adapter, or a header that cannot be read: reported elsewhere)."""
    header = _safetensors_header(path)
    keys = [k for k in header or {} if k != "__metadata__"]
    if not keys or any(mark in k.lower() for k in keys for mark in _ADAPTER_KEY_MARKS):
        return None
    return sorted(keys)[0]


def _safetensors_header(path: str) -> dict[str, Any] | None:
    """The JSON header of a safetensors file, ``None`` when it cannot be read as one."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length > min(_MAX_HEADER, os.fstat(f.fileno()).st_size - 8):
                return None
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return header if isinstance(header, dict) else None


def _safetensors_header_problem(path: str) -> str | None:
    """Why ``path`` does not start with a safetensors header declaring a tensor, else ``None``."""
    try:
        with open(path, "rb") as f:
            size = f.read(8)
            if len(size) < 8:
                return "shorter than its 8-byte header length"
            length = int.from_bytes(size, "little")
            if length > min(_MAX_HEADER, os.fstat(f.fileno()).st_size - 8):
                return f"its header length {length} does not fit the file"
            header = json.loads(f.read(length))
    except OSError as exc:
        return f"cannot read it: {exc.strerror}"
    except (UnicodeDecodeError, ValueError):
        return "its header is not JSON"
    if not isinstance(header, dict) or not any(k != "__metadata__" for k in header):
        return "its header declares no tensor"
    return None


def adapter_rank(path: str) -> int | None:
    """The largest rank in an adapter folder's ``adapter_config.json`` (``r``, ``rank_pattern``)."""
    try:
        with open(os.path.join(os.path.expanduser(path), "adapter_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
        return max(int(r) for r in ranks if isinstance(r, int | float) and not isinstance(r, bool))
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # the adapter checks that follow name what is wrong with the file


def _check_llm_lora(scan: Scan, defaults: dict[str, Any]) -> None:
    """``--lora-modules`` on the one LLM stage: LoRA enabled, every adapter's rank within the limit."""
    modules = scan.values.get("--lora-modules", [])
    if not modules:
        return
    if "--enable-lora" not in scan.values or "--no-enable-lora" in scan.values:
        raise ConfigError(
            f"--lora-modules {modules[0]}: LoRA is off on this LLM model; add --enable-lora "
            "(and --max-lora-rank at least the adapters' rank)"
        )
    given = scan.last("--max-lora-rank")
    try:
        limit = int(given) if given is not None else int(defaults.get("max_lora_rank", DEFAULT_MAX_LORA_RANK))
    except ValueError:
        return
    for value in modules:
        rank = adapter_rank(parse_lora_module(value)[1])
        if rank is not None and rank > limit:
            source = f"--max-lora-rank {limit}" if given is not None else f"--max-lora-rank (default {limit})"
            raise ConfigError(
                f"--lora-modules {value}: adapter_config.json has rank {rank}, above {source}; "
                f"pass --max-lora-rank {rank} or higher"
            )
