"""How a response's final answer is read, for the verifiers that score an answer string (reasoning-gym's
``score_answer``): the ``reward.answer`` option. The answer format is part of the reward's design: a prompt that asks
for ``<answer>`` tags and a model that never writes them score 0 under ``tagged`` whatever they compute.

- ``tagged`` (the default): the content of the last ``<answer>...</answer>``, stripped (reasoning-gym's
  ``extract_answer``, the format reasoning-gym's prompts ask for); a response without tags is read whole, stripped.
- ``last_number``: the last number of the response: an optional ASCII minus, digits (thousands commas allowed and
  removed: "1,234" -> "1234"), an optional decimal part ("2.50" stays "2.50"; no fractions, no exponents). Chat
  models that answer in a sentence ("5 - 3 = 2.") are read this way. No number: "".
- ``boxed``: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced, stripped (`last_boxed`,
  the rule the math verifier applies first). No box, or one cut off before its closing brace: "".

The string goes to the verifier unchanged beyond this; e.g. reasoning-gym's default ``score_answer`` gives 1.0 for
an exact match and len(gold)/len(answer) when the gold string is inside it, so "12" for gold "2" earns 0.5 there (a
row counts as correct only at 1.0).
"""

from __future__ import annotations

import re
from typing import Literal

AnswerFormat = Literal["tagged", "last_number", "boxed"]
ANSWER_FORMATS: tuple[str, ...] = ("tagged", "last_number", "boxed")

_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``/``\\fbox{...}`` with balanced braces (``\\boxed 5``: up to the next
    whitespace or ``$``); "" when the last box is never closed (cut off); None when there is no box."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # "\boxed 5": up to the next whitespace or "$"
        match = re.match(r"[^\s$]+", text[i:])
        return match.group(0) if match else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return ""  # unbalanced: the answer was cut off (e.g. at the token limit); nothing may rescue it


def last_number(text: str) -> str | None:
    """The last plain number of ``text`` (module docstring, ``last_number``), thousands commas removed; None if none."""
    found = None
    for found in _PLAIN_NUMBER.finditer(text):  # noqa: B007 - the loop keeps the last match
        pass
    return None if found is None else found.group(0).replace(",", "")


def tagged(text: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` (reasoning-gym's extract_answer's rule), or None."""
    matches = list(re.finditer(r"<answer>\s?(.*?)\s?</answer>", text, flags=re.DOTALL))
    return matches[-1].group(1).strip() if matches else None


def read_answer(response: str, answer: str) -> str:
    """The answer string of ``response`` under the format ``answer`` (module docstring); ValueError for an unknown
    format."""
    if answer == "tagged":
        found = tagged(response)
        return found if found is not None else response.strip()
    if answer == "last_number":
        return last_number(response) or ""
    if answer == "boxed":
        return (last_boxed(response) or "").strip()
    raise ValueError(f"reward.answer: expected one of {list(ANSWER_FORMATS)}, got {answer!r}")
