"""Parsing of the stage-scoped inputs: ``stage_overrides``, ``stage_N_<key>`` and deploy YAML.

Each parser fails at once with a message naming the input it could not read, so a
malformed override never reaches engine start.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from vllm_omni.errors import ConfigError, did_you_mean

_STAGE_KEY = re.compile(r"^stage_(\d+)_(.+)$")


@dataclass(frozen=True)
class InputNames:
    """How error messages name each input path: the Python spellings by default,
    :data:`CLI_INPUT_NAMES` for ``vllm serve ... --omni``."""

    stage_overrides: str = "stage_overrides"
    cli: bool = False

    def global_option(self, key: str) -> str:
        """The name of global option ``key``: ``--max-lora-rank`` or ``keyword argument 'max_lora_rank'``."""
        return f"--{key.replace('_', '-')}" if self.cli else f"keyword argument {key!r}"


PYTHON_INPUT_NAMES = InputNames()
CLI_INPUT_NAMES = InputNames(stage_overrides="--stage-overrides", cli=True)


suggest = did_you_mean  # `` (did you mean 'x'?)`` for the closest candidate, or ``""``


def validation_problems(exc: ValidationError) -> list[tuple[tuple, str, str, Any]]:
    """``(loc, type, text, input)`` of each error in a pydantic ``ValidationError``; ``text`` is
    the raising validator's own message for value errors, pydantic's short ``msg`` otherwise."""
    out = []
    for err in exc.errors():
        cause = (err.get("ctx") or {}).get("error")
        kind = err.get("type", "")
        text = str(cause) if kind == "value_error" and cause is not None else err["msg"]
        out.append((tuple(err.get("loc", ())), kind, text, err.get("input")))
    return out


def _loc_path(loc: tuple) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _deploy_schema_error(name: str, exc: ValidationError) -> ConfigError:
    """``deploy config <file>, stages[1].stage_id: <what is wrong> (got <value>)`` per error."""
    lines = []
    for loc, kind, text, value in validation_problems(exc):
        where = f"{name}, {_loc_path(loc)}" if loc else name
        if kind == "extra_forbidden" and loc:
            allowed = list(DeployConfig.model_fields)
            lines.append(f"{where}: unknown key{suggest(str(loc[-1]), allowed)}; allowed: {allowed}")
        else:
            lines.append(f"{where}: {text} (got {value!r})")
    return ConfigError("; ".join(lines))


def _stage_id(key: Any, source: str) -> int:
    if isinstance(key, bool):
        raise ConfigError(f"{source}: stage id must be an integer, got {key!r}")
    if isinstance(key, int):
        stage_id = key
    elif isinstance(key, str) and key.strip().isascii() and key.strip().isdecimal():
        stage_id = int(key)
    else:
        raise ConfigError(f'{source}: keys must be stage ids (integers such as "0"), got {key!r}')
    if stage_id < 0:
        raise ConfigError(f"{source}: stage id must be >= 0, got {stage_id}")
    return stage_id


def parse_stage_overrides(value: Any, source: str = "stage_overrides") -> dict[int, dict[str, Any]]:
    """Parse ``stage_overrides``: a dict or a JSON object string keyed by stage id.

    Example: ``'{"0": {"enable_lora": true, "max_lora_rank": 64}}'``.

    Returns:
        ``{stage_id: {option: value}}`` (a new dict; the input is not modified).

    Raises:
        ConfigError: invalid JSON, not an object, a key that is not a stage id, or a value
            that is not an object of options; the message names ``source``.
    """
    if value is None:
        return {}
    if isinstance(value, str | bytes):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{source} is not valid JSON ({exc.msg} at position {exc.pos}): {value!r}"
            ) from exc
    if not isinstance(value, dict):
        raise ConfigError(
            f'{source} must be an object keyed by stage id, e.g. \'{{"0": {{"enable_lora": true}}}}\'; '
            f"got {type(value).__name__}: {value!r}"
        )
    out: dict[int, dict[str, Any]] = {}
    for key, options in value.items():
        stage_id = _stage_id(key, source)
        if not isinstance(options, dict):
            raise ConfigError(
                f"{source}[{key!r}] must be an object of options for stage {stage_id}, "
                f"got {type(options).__name__}: {options!r}"
            )
        bad_keys = [k for k in options if not isinstance(k, str)]
        if bad_keys:
            raise ConfigError(f"{source}[{key!r}]: option names must be strings, got {bad_keys!r}")
        if stage_id in out:
            raise ConfigError(f"{source}: stage {stage_id} is given twice")
        out[stage_id] = dict(options)
    return out


def split_stage_scoped_keys(options: dict[str, Any]) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """Split ``stage_N_<key>`` entries out of a flat option dict.

    Returns:
        ``(global_options, {stage_id: {key: value}})``.
    """
    global_opts: dict[str, Any] = {}
    scoped: dict[int, dict[str, Any]] = {}
    for key, value in options.items():
        match = _STAGE_KEY.match(key)
        if match:
            scoped.setdefault(int(match.group(1)), {})[match.group(2)] = value
        else:
            global_opts[key] = value
    return global_opts, scoped


class DeployStageEntry(BaseModel):
    """One ``stages:`` entry of a deploy YAML: ``stage_id``, engine fields, ``engine_extras``."""

    model_config = ConfigDict(extra="allow")

    stage_id: int = Field(ge=0)
    engine_extras: dict[str, Any] = Field(default_factory=dict)

    @field_validator("stage_id", mode="before")
    @classmethod
    def _no_bool_stage_id(cls, value: Any) -> Any:
        if isinstance(value, bool):  # YAML `true` would otherwise become stage 1
            raise ValueError(f"stage_id must be an integer, got {value!r}")
        return value

    def options(self, source: str = "deploy config") -> dict[str, Any]:
        """Top-level fields merged with ``engine_extras`` (a key in both is an error naming ``source``)."""
        top = dict(self.model_extra or {})
        both = sorted(set(top) & set(self.engine_extras))
        if both:
            raise ConfigError(
                f"{source}, stage {self.stage_id}: {both} set both as stage fields and in engine_extras",
                options=both,
            )
        return {**top, **self.engine_extras}


class DeployConfig(BaseModel):
    """A deploy YAML: optional ``pipeline`` name, ``model``, ``worker_backend`` and ``ray_address``, and a ``stages:`` list."""

    model_config = ConfigDict(extra="forbid")

    pipeline: str | None = None
    model: str | None = None
    worker_backend: str | None = None
    ray_address: str | None = None
    stages: list[DeployStageEntry] = Field(default_factory=list)
    _source_name: str = PrivateAttr(default="deploy config")

    @property
    def source_name(self) -> str:
        """How messages name this config: ``deploy config '<file>'`` (or ``deploy config``)."""
        return self._source_name

    def stage_source(self, stage_id: int) -> str:
        """``deploy config '<file>', stages[<i>]``: where stage ``stage_id``'s entry is."""
        for i, entry in enumerate(self.stages):
            if entry.stage_id == stage_id:
                return f"{self.source_name}, stages[{i}]"
        return self.source_name

    def stage_options(self) -> dict[int, dict[str, Any]]:
        """``{stage_id: options}``; a stage id listed twice is an error."""
        out: dict[int, dict[str, Any]] = {}
        for entry in self.stages:
            if entry.stage_id in out:
                raise ConfigError(f"{self.source_name}: stage_id {entry.stage_id} is listed twice")
            out[entry.stage_id] = entry.options(self.stage_source(entry.stage_id))
        return out


def load_deploy_config(source: str | os.PathLike | dict | DeployConfig | None) -> DeployConfig | None:
    """Read a deploy config from a YAML path, a dict or a ``DeployConfig``.

    Raises:
        ConfigError: unreadable file, invalid YAML or a schema violation (message names the file).
    """
    if source is None or isinstance(source, DeployConfig):
        return source
    name = "deploy config"
    data = source
    if isinstance(source, str | os.PathLike):
        name = f"deploy config {os.fspath(source)!r}"
        try:
            with open(source) as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read {name}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{name} is not valid YAML: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{name} is not UTF-8 text: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must be a mapping with a 'stages:' list, got {type(data).__name__}")
    try:
        deploy = DeployConfig.model_validate(data)
    except ValidationError as exc:
        raise _deploy_schema_error(name, exc) from exc
    deploy._source_name = name
    return deploy
