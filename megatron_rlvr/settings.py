"""Declared settings: each configuration field's doc and limits, beside its default, in one place.

A section's dataclass (``<wing>/config.py``) declares a field as ``name: type = setting(default, "doc", ge=0)``;
the allowed values of a ``Literal`` type are its limits already. The loader (``megatron_rlvr.config``) checks every
value it reads against them, once, with an error naming the key, and ``megatron-rlvr config explain KEY`` prints
the doc, the default and the limits. Nothing here checks a dataclass built in code: its author chose the values.

This module is at the bottom of the layers: it imports nothing of the project.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DOC, LIMITS = "doc", "limits"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


@dataclass(frozen=True)
class Limits:
    """What a numeric value must satisfy (bounds, finiteness), or a check of one's own; None values are not
    checked (an optional field's ``null``)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = False
    check: Callable[[Any], bool] | None = None  # True: the value is allowed
    expect: str = ""  # what ``check`` allows, in words (shown in errors and by explain)

    def allows(self, value: Any) -> bool:
        if value is None:
            return True
        if self.check is not None and not self.check(value):
            return False
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        if math.isnan(value) or (self.finite and math.isinf(value)):
            return False
        return not (
            (self.ge is not None and not value >= self.ge)
            or (self.gt is not None and not value > self.gt)
            or (self.le is not None and not value <= self.le)
            or (self.lt is not None and not value < self.lt)
        )

    def describe(self) -> str:
        """The limits in words: ``in [0, 1)``, ``>= 1``, ``> 0, finite``."""
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        high = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        parts = []
        if low and high:
            parts.append(f"in {low[0]}{_number(low[1])}, {_number(high[1])}{high[0]}")
        elif low:
            parts.append(f"{'>=' if low[0] == '[' else '>'} {_number(low[1])}")
        elif high:
            parts.append(f"{'<=' if high[0] == ']' else '<'} {_number(high[1])}")
        if self.finite and not (low and high):
            parts.append("finite")
        if self.expect:
            parts.append(self.expect)
        return ", ".join(parts)


def setting(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    finite: bool = False,
    check: Callable[[Any], bool] | None = None,
    expect: str = "",
) -> Any:
    """A dataclass field with its ``doc`` and limits (see `Limits`); ``factory`` for a mutable default."""
    limits = Limits(ge, gt, le, lt, finite, check, expect)
    metadata = {DOC: " ".join(doc.split()), LIMITS: limits if limits != Limits() else None}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def doc_of(f: dataclasses.Field) -> str:
    return f.metadata.get(DOC, "")


def limits_of(f: dataclasses.Field) -> Limits | None:
    return f.metadata.get(LIMITS)
