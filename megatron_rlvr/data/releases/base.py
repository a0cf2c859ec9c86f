"""What every release reader shares: the converted record (`Prepared`), the options, a reader's `Release`
description, `Skip`, and the text helpers (normalize, content ids, field lookup, chat prompts)."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Skip(Exception):
    """This record is not used; the message is the reason (counted, and named with the row with --strict)."""


@dataclass(frozen=True)
class Prepared:
    problem: str  # the problem as released (the overlap check reads this)
    answer: Any  # the verifier's reference: a string (math, logic) or a dict (code)
    task: str  # math | logic | code
    prompt: str = ""  # the text the model gets (problem + the answer-format instruction); default: problem
    id: str = ""  # the release's own id, when it has one


@dataclass
class Options:
    levels: frozenset[int] | None = None  # MATH levels kept (None: all)
    instruction: bool = True  # append the answer-format instruction the eval uses


@dataclass(frozen=True)
class Release:
    name: str
    convert: Callable[[dict, Options], Prepared]
    layout: str
    uses_levels: bool = False


def normalize(text: str) -> str:
    """Text for comparisons: NFKC, lower case, every run of non-alphanumerics one space."""
    text = unicodedata.normalize("NFKC", text).lower()
    return re.sub(r"[\W_]+", " ", text).strip()


def content_id(name: str, problem: str) -> str:
    """A stable row id from the problem's normalized text (the same problem gets the same id in every layout)."""
    return f"{name}-{hashlib.sha1(normalize(problem).encode()).hexdigest()[:12]}"


def first(record: dict, *names: str) -> Any:
    for name in names:
        value = record.get(name)
        if value is not None and value != "":
            return value
    return None


def chat_text(value: Any) -> str | None:
    """A prompt given as a string, or as chat messages (verl/HF style): the last user message."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return None
