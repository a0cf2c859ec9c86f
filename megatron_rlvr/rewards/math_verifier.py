"""Math answers: extract the final answer from a response and check it against the gold answer with math-verify.

Final-answer extraction rules, applied to the response in this order (the first rule that finds something wins):
1. If the response contains ``</think>``, only the text after the last one is read (the reasoning is not graded).
2. The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; ``\\boxed 5`` also counts.
   A last box that is empty or never closed (cut off at the token limit) means no answer: later rules do not
   rescue it, since a truncated "\\boxed{7" may have been heading for 72.
3. Else the text after the last "final answer is", "answer is" or "answer:" (case-insensitive), up to the end of
   that line, with surrounding ``$``, ``**`` and a trailing period removed.
4. Else the last number in the text: an optional sign, digits with optional thousands commas, an optional decimal
   part, optionally ``a/b``.
Nothing found scores 0. Thousands separators ("1,000") are removed from a plain number before it is compared.
Only the last ``MAX_RESPONSE_CHARS`` characters (after ``</think>``) are read, so megabytes of text cost little.

Guards (so pathological answers score 0 fast instead of stalling a worker): an extracted answer longer than
``MAX_ANSWER_CHARS`` or nested deeper than ``MAX_NESTING`` (braces, brackets, parentheses or ``^``) scores 0 before
any parsing; math-verify's own ``signal.alarm`` timeouts bound parsing and comparison; the verifier pool adds a
wall timeout per item on top and replaces a worker that is stuck anyway (see `pool.py`). Because of the alarm this
module must run in a process's main thread: the trainer calls it through the pool, never from threads.

Comparison: the gold string is parsed as LaTeX (wrapped in ``$...$`` unless it already holds ``\\boxed``), the
extracted answer is parsed as ``\\boxed{answer}``, and math-verify decides equivalence (numbers to 6 decimals,
symbolic equality, sets, intervals, matrices, percent). If either side fails to parse, the normalized strings must
be equal.
"""

from __future__ import annotations

import re
import threading

from megatron_rlvr.rewards.answers import last_boxed

MAX_ANSWER_CHARS = 512
MAX_RESPONSE_CHARS = 100_000  # only the response's tail is read: the final answer is at the end
_LAST_NUMBER_WINDOW = 4096
MAX_NESTING = 24
PARSE_TIMEOUT_S = 3
VERIFY_TIMEOUT_S = 3

_ANSWER_PHRASE = re.compile(r"(?:final answer is|answer is|answer:)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _after_phrase(text: str) -> str | None:
    last = None
    for last in _ANSWER_PHRASE.finditer(text):  # noqa: B007 - the loop keeps the last match
        pass
    if last is None:
        return None
    line = text[last.end() :].split("\n", 1)[0].strip().lstrip(":").strip()
    line = line.replace("**", "").strip()
    line = line.rstrip(".").strip()
    if line.startswith("$") and line.endswith("$") and len(line) >= 2:
        line = line.strip("$").strip()
    return line or None


def extract_answer(response: str) -> str | None:
    """The final answer of ``response`` by the rules in the module docstring, or None."""
    think_end = response.rfind("</think>")
    if think_end >= 0:
        response = response[think_end + len("</think>") :]
    response = response[-MAX_RESPONSE_CHARS:]
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip() or None
    found = _after_phrase(response)
    if found is not None and found.strip():
        return found.strip()
    for window in (response[-_LAST_NUMBER_WINDOW:], response):  # the last number is almost always near the end
        last = None
        for last in _NUMBER.finditer(window):  # noqa: B007 - the loop keeps the last match
            pass
        if last is not None:
            return last.group(0).strip()
    return None


def _nesting_depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        if ch in "{[(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}])":
            depth = max(0, depth - 1)
    return max(deepest, text.count("^"))


def is_pathological(answer: str) -> bool:
    """True when an answer is too long or too deeply nested to be worth handing to the symbolic parser."""
    return len(answer) > MAX_ANSWER_CHARS or _nesting_depth(answer) > MAX_NESTING


def _normalize_plain(answer: str) -> str:
    answer = answer.strip().strip("$").strip()
    if _THOUSANDS.match(answer):
        answer = answer.replace(",", "")
    return answer


def _loose_string(answer: str) -> str:
    return re.sub(r"\s+", "", answer).rstrip(".").lower()


def verify_math(response: str, gold: str) -> float:
    """1.0 when the response's final answer is equivalent to ``gold``, else 0.0 (never raises on model output)."""
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"math reference: expected a non-empty gold answer string, got {gold!r:.200}")
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    answer = _normalize_plain(answer)
    if not answer or is_pathological(answer):
        return 0.0
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "verify_math: math-verify times out with signal.alarm, so it must run in a process's main "
            "thread; score math through RewardPool (worker processes) instead of threads"
        )
    from math_verify import parse, verify  # heavy (sympy): imported by the worker that needs it

    gold_text = gold if "\\boxed" in gold else f"${_normalize_plain(gold)}$"
    gold_parsed = parse(gold_text, parsing_timeout=PARSE_TIMEOUT_S)
    answer_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=PARSE_TIMEOUT_S)
    if gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=VERIFY_TIMEOUT_S):
        return 1.0
    gold_answer = extract_answer(gold) if "\\boxed" in gold else gold
    return (
        1.0
        if gold_answer is not None and _loose_string(_normalize_plain(gold_answer)) == _loose_string(answer)
        else 0.0
    )
