"""Logic answers (SynLogic- and BBH-style): extract the final answer, then exact or normalized string match.

Extraction, first rule that finds something wins: the content of the last ``<answer>...</answer>`` (SynLogic's
convention); the last ``\\boxed{...}``; the text after the last "the answer is" (BBH's chain-of-thought prompts end
with "So the answer is X."), up to the end of that line, less the sentence's final period; else the last non-empty line.

Normalized match (the default) compares both sides after: removing markdown emphasis, surrounding quotes/``$`` and a
trailing period; lower-casing; collapsing whitespace and dropping it around ``, ; : [ ] ( ) { }``; and reducing a
multiple-choice letter in any of the forms "(A)", "A)", "A.", "option A", also followed by the option's text
("(A) Monday"), to "a" when the gold is such a letter.
"True"/"Yes"/"valid" are not conflated with each other: BBH's tasks each use one vocabulary, and the gold names it.
Exact match compares the extracted answer, stripped, with the gold, stripped.
"""

from __future__ import annotations

import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_ANSWER_IS = re.compile(r"the answer is", re.IGNORECASE)
_CHOICE = re.compile(r"^(?:option\s+|choice\s+)?\(?([a-z])\)?[.:]?$")
# an answer that starts with the letter and goes on with the option's text: "(A) Monday", "B. 12 apples"
_LEADING_CHOICE = re.compile(r"^(?:option\s+|choice\s+)?(?:\(([a-z])\)|([a-z])[.):])(?:\s|$)")
MAX_LOGIC_ANSWER_CHARS = 4096


def extract_logic_answer(response: str) -> str | None:
    """The final answer of a logic response by the rules in the module docstring, or None."""
    tags = _ANSWER_TAG.findall(response)
    if tags:
        return tags[-1].strip()
    from megatron_rlvr.rewards.answers import last_boxed  # the same brace-balanced \boxed reader

    boxed = last_boxed(response)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    last = None
    for last in _ANSWER_IS.finditer(response):  # noqa: B007 - the loop keeps the last match
        pass
    if last is not None:
        line = response[last.end() :].split("\n", 1)[0].strip().lstrip(":").strip()
        line = line[:-1].rstrip() if line.endswith(".") else line  # the sentence's period, not the answer's
        if line:
            return line
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def normalize_logic_answer(answer: str) -> str:
    text = answer.replace("**", "").replace("__", "").strip()
    text = text.strip("`'\"$ ").rstrip(".").strip()
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\s+", " ", text.lower())
    text = re.sub(r"\s*([,;:\[\](){}])\s*", r"\1", text)
    return text.strip()


def _choice_letter(text: str) -> str | None:
    match = _CHOICE.match(text)
    if match:
        return match.group(1)
    match = _LEADING_CHOICE.match(text)
    return (match.group(1) or match.group(2)) if match else None


def verify_logic(response: str, gold: str, mode: str = "normalized") -> float:
    """1.0 when the response's final answer matches ``gold`` (``mode`` "normalized" or "exact"), else 0.0."""
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"logic reference: expected a non-empty gold answer string, got {gold!r:.200}")
    if mode not in ("normalized", "exact"):
        raise ValueError(f"logic match mode: expected 'normalized' or 'exact', got {mode!r}")
    answer = extract_logic_answer(response)
    if answer is None or len(answer) > MAX_LOGIC_ANSWER_CHARS:
        return 0.0
    if mode == "exact":
        return 1.0 if answer.strip() == gold.strip() else 0.0
    norm_answer, norm_gold = normalize_logic_answer(answer), normalize_logic_answer(gold)
    if norm_answer == norm_gold:
        return 1.0
    gold_letter = _choice_letter(norm_gold)
    if gold_letter is not None:
        # read the letter before spaces around brackets are dropped: "(C) 05/01" must not become "(c)05/01"
        light = re.sub(r"\s+", " ", answer.replace("**", "").strip().strip("`'\"$ ").lower())
        return 1.0 if gold_letter in (_choice_letter(norm_answer), _choice_letter(light)) else 0.0
    return 0.0
