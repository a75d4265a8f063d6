"""Typed configs: pydantic models loaded from YAML and overridden from the CLI.

Every config rejects unknown fields, so a typo such as ``lerning_rate`` fails at
the edge with the field's dotted path instead of being silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from mlplat.errors import ConfigError

C = TypeVar("C", bound="Config")


class Config(BaseModel):
    """Base of every mlplat config: strict about field names, frozen after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: ``source: field.path: message``."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check its spelling; see the config class for valid fields)"
        lines.append(f"{source}: {where}: {msg}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=1e-3`` -> (["a", "b"], 0.001); the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. train.lr=1e-3")
    return key.split("."), yaml.safe_load(raw) if raw else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = dict(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[path[-1]] = value
    return data


def validate(cls: type[C], data: dict, source: str = "config") -> C:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] = ()) -> C:
    """Load ``cls`` from a YAML file (optional) with ``KEY=VALUE`` overrides applied on top."""
    data: dict = {}
    source = "overrides"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}".replace("\n", " ")) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of fields at the top level")
    return validate(cls, apply_overrides(data, list(overrides)), source)


def to_flat_params(cfg: BaseModel, prefix: str = "") -> dict[str, str]:
    """Flatten a config into ``a.b: value`` strings (MLflow params)."""
    flat: dict[str, str] = {}
    for key, value in cfg.model_dump(mode="json").items():
        _flatten(f"{prefix}{key}", value, flat)
    return flat


def _flatten(key: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{key}.{k}", v, out)
    else:
        out[key] = str(value)
