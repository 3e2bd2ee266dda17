"""Parsing of the stage-scoped inputs: ``stage_overrides``, ``stage_N_<key>`` and deploy YAML.

Each parser fails at once with a message naming the input it could not read, so a
malformed override never reaches engine start.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vllm_omni.errors import ConfigError

_STAGE_KEY = re.compile(r"^stage_(\d+)_(.+)$")


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

    def options(self) -> dict[str, Any]:
        """Top-level fields merged with ``engine_extras`` (a key in both is an error)."""
        top = dict(self.model_extra or {})
        both = sorted(set(top) & set(self.engine_extras))
        if both:
            raise ConfigError(
                f"deploy config stage {self.stage_id}: {both} set both as stage fields and in engine_extras"
            )
        return {**top, **self.engine_extras}


class DeployConfig(BaseModel):
    """A deploy YAML: optional ``pipeline`` name and ``model``, and a ``stages:`` list."""

    model_config = ConfigDict(extra="forbid")

    pipeline: str | None = None
    model: str | None = None
    stages: list[DeployStageEntry] = Field(default_factory=list)

    def stage_options(self) -> dict[int, dict[str, Any]]:
        """``{stage_id: options}``; a stage id listed twice is an error."""
        out: dict[int, dict[str, Any]] = {}
        for entry in self.stages:
            if entry.stage_id in out:
                raise ConfigError(f"deploy config: stage_id {entry.stage_id} is listed twice")
            out[entry.stage_id] = entry.options()
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
        return DeployConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{name} is invalid: {exc}") from exc
