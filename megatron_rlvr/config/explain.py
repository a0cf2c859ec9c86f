"""`megatron-rlvr config explain KEY`: what a configuration key means, from the field's own declaration.

A field (``algo.distill.crpo.tau``) prints its type, default and limits, its doc and the rules that relate it to
other fields; a section (``algo.distill``, or nothing: the whole config) lists its fields one line each, sections
with their own line. An old key prints what to set instead; an unknown one is a one-line error with the nearest.

    megatron-rlvr config explain algo.distill.crpo.tau
    megatron-rlvr config explain algo.loss
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import textwrap
import typing
from typing import Any

from megatron_rlvr.config.renamed import instead
from megatron_rlvr.config.rules import rules_of
from megatron_rlvr.config.run import Config
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.settings import doc_of, limits_of

WIDTH = 100


def _section_type(tp: Any) -> type | None:
    """The dataclass a field holds (also behind ``X | None``), or None for a value."""
    for option in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(option):
            return option
    return None


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is None and hasattr(tp, "__name__"):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("NoneType", "None")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "(a section)" if dataclasses.is_dataclass(value) else value
    return "(required)"


def _resolve(key: str) -> tuple[type, dataclasses.Field | None, Any]:
    """(the section type holding ``key``, its field or None for the root, the field's type)."""
    cls: type = Config
    field, tp = None, Config
    path = [p for p in key.split(".") if p]
    for i, part in enumerate(path):
        section = _section_type(tp)
        if section is None:
            raise ConfigError(f"{'.'.join(path[:i])}: a value, not a section; explain {'.'.join(path[:i])}")
        fields = {f.name: f for f in dataclasses.fields(section)}
        if part not in fields:
            so_far = ".".join(path[: i + 1])
            moved = instead(so_far, None)
            if moved:
                raise ConfigError(moved)
            near = difflib.get_close_matches(part, fields, n=1, cutoff=0.6)
            prefix = ".".join(path[:i])
            hint = f"did you mean {prefix + '.' if prefix else ''}{near[0]}? " if near else ""
            raise ConfigError(f"{so_far}: unknown key; {hint}allowed keys: {', '.join(sorted(fields))}")
        cls, field = section, fields[part]
        tp = typing.get_type_hints(section)[part]
    return cls, field, tp


def explain(key: str) -> str:
    """The text ``megatron-rlvr config explain KEY`` prints."""
    _, field, tp = _resolve(key)
    section = _section_type(tp)
    if section is not None:
        return _explain_section(key, section, field)
    assert field is not None  # a value is a field of some section
    return _explain_field(key, field, tp)


def _explain_field(key: str, field: dataclasses.Field, tp: Any) -> str:
    limits = limits_of(field)
    lines = [f"{key}: {_type_name(tp)} = {_default(field)!r}"]
    if limits is not None:
        lines.append(f"  limits: {limits.describe()}")
    doc = doc_of(field)
    if doc:
        lines += textwrap.wrap(doc, WIDTH, initial_indent="  ", subsequent_indent="  ")
    related = [[k for k in r.keys if k != key] for r in rules_of(key)]
    if related:
        lines.append("  checked with: " + "; ".join(", ".join(keys) for keys in related if keys))
    return "\n".join(lines)


def _explain_section(key: str, section: type, field: dataclasses.Field | None) -> str:
    title = key or "the run config"
    lines = [f"{title}: {(section.__doc__ or '').strip().splitlines()[0] if section.__doc__ else ''}".rstrip()]
    if field is not None and doc_of(field):
        lines[0] = f"{title}: {doc_of(field)}"
    hints = typing.get_type_hints(section)
    for f in dataclasses.fields(section):
        name = f"{key}.{f.name}" if key else f.name
        if _section_type(hints[f.name]) is not None:
            lines.append(f"  {name}: (section) {doc_of(f)}")
            continue
        limits = limits_of(f)
        bound = f"; {limits.describe()}" if limits is not None else ""
        choices = f"; one of {_type_name(hints[f.name])}" if typing.get_origin(hints[f.name]) is typing.Literal else ""
        lines.append(f"  {name} = {_default(f)!r}{choices}{bound}")
    lines.append(f"megatron-rlvr config explain {key + '.' if key else ''}NAME: a field's doc")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rlvr config", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    explain_parser = sub.add_parser("explain", help="a key's doc, default and limits; a section's fields")
    explain_parser.add_argument("key", nargs="?", default="", help="a dotted key or section, e.g. algo.loss.alpha")
    args = parser.parse_args(argv)
    print(explain(args.key))
    return 0
