"""Typed construction of the run config from plain data: YAML recipes and dotted ``key=value`` overrides.

Every key and value is checked once, here: the key against its section's fields (an old key gets the one line
naming its new one: renamed.py), the value against the field's type (a ``Literal`` names its allowed values) and
the limits the field declares (megatron_rlvr/settings.py); then the ``load`` rules between fields (rules.py). Every
error is one line naming the key and what was expected. ``to_dict`` / ``differences`` are what checkpoints store
and what a resume compares.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_rlvr.config import rules
from megatron_rlvr.config.renamed import instead
from megatron_rlvr.config.run import Config
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.settings import limits_of


def from_dict(cls: type, data: Mapping[str, Any] | None, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from nested plain data, checking every key and value type."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        moved = instead(prefix, data)
        if moved:
            raise ConfigError(moved)
        raise ConfigError(f"{prefix or '<root>'}: expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = _join(prefix, unknown[0])
        moved = instead(key, data[unknown[0]])
        if moved:
            raise ConfigError(moved)
        near = difflib.get_close_matches(unknown[0], fields, n=1, cutoff=0.6)
        hint = f"did you mean {_join(prefix, near[0])}? " if near else ""
        raise ConfigError(f"{key}: unknown key; {hint}allowed keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        key = _join(prefix, name)
        kwargs[name] = _convert(hints[name], value, key)
        limits = limits_of(fields[name])
        if limits is not None and not limits.allows(kwargs[name]):
            raise ConfigError(f"{key}: expected {limits.describe()}, got {value!r}")
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``"key: old -> new"`` for every dotted key whose value differs between two ``to_dict`` trees."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b, name = old.get(key), new.get(key), _join(prefix, key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += differences(a, b, name)
        elif _plain(a) != _plain(b):  # a tree read back from JSON has lists where the dataclasses had tuples
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(option, value, key)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1 and isinstance(value, Mapping):  # one section type, optional: its own error names the key
            raise ConfigError(errors[0])
        raise ConfigError(f"{key}: expected {' or '.join(_describe(a) for a in args)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}: got {value!r}; allowed values: {', '.join(repr(a) for a in args)}")
    if origin in (list, Sequence, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_tp,) = args[:1] or (Any,)
        return [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected str, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {_describe(tp)}")


# ---------------------------------------------------------------------------------------------------------------
# YAML + dotted overrides


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"actor.tp=2"`` -> (["actor", "tp"], 2); the value is read as YAML (numbers, bools, null, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. actor.tp=2")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: the key must be dotted names, e.g. algo.alpha=0.05")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                moved = instead(".".join(path[: i + 1]), child)
                raise ConfigError(moved or f"override {text!r}: {part} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML recipe (or nothing: all defaults), apply ``key=value`` overrides, and type-check it all."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path}: not found; give a YAML recipe, e.g. configs/demo_cpu.yaml")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    return config_of(apply_overrides(data, overrides))


def config_of(data: Mapping[str, Any]) -> Config:
    """The run config of a recipe's plain data: every key, type and limit checked, then the ``load`` rules."""
    cfg = from_dict(Config, data)
    rules.check(cfg, "load")
    return cfg


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
