"""Verifier of the countdown demo task: reach a target by arithmetic over a multiset of given numbers.

Contract (the demo's generator writes references to it): the reference is ``{"numbers": [ints], "target": int}``.
The response's first line (text up to the first newline, stripped) must be an arithmetic expression made only of
non-negative integer literals, ``+ - * /`` and parentheses, at most 200 characters. Each literal must be one of the
given numbers, each used at most as many times as given (a sub-multiset: not all must be used). The expression is
evaluated exactly with fractions and must equal the target. Anything else — empty line, other characters, unary
minus, ``**`` or ``//``, leading zeros, division by zero — scores 0. The expression is parsed with ``ast`` and
walked by hand: nothing is ever evaluated by Python.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

MAX_EXPRESSION_CHARS = 200
_ALLOWED_CHARS = frozenset("0123456789+-*/() \t")
_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,  # Fraction division; ZeroDivisionError is caught by the caller
}


class _Rejected(Exception):
    """The expression uses something outside the countdown grammar."""


def check_reference(reference: Any) -> tuple[list[int], int]:
    """The (numbers, target) of a countdown reference; ValueError naming the field when it is malformed."""
    if not isinstance(reference, Mapping):
        raise ValueError(
            f"countdown reference: expected a dict {{'numbers': [ints], 'target': int}}, got {reference!r:.200}"
        )
    numbers, target = reference.get("numbers"), reference.get("target")
    if not isinstance(numbers, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in numbers
    ):
        raise ValueError(f"countdown reference: 'numbers' must be a list of ints, got {numbers!r:.200}")
    if not isinstance(target, int) or isinstance(target, bool):
        raise ValueError(f"countdown reference: 'target' must be an int, got {target!r:.200}")
    return list(numbers), target


def _evaluate(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _evaluate(node.left, literals)
        right = _evaluate(node.right, literals)
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        literals.append(node.value)
        return Fraction(node.value)
    raise _Rejected(type(node).__name__)


def score_countdown(response: str, reference: Mapping[str, Any]) -> float:
    """1.0 when the response's first line is a valid expression over the numbers that equals the target, else 0."""
    numbers, target = check_reference(reference)
    expression = response.split("\n", 1)[0].strip()
    if not expression or len(expression) > MAX_EXPRESSION_CHARS or not set(expression) <= _ALLOWED_CHARS:
        return 0.0
    try:
        tree = ast.parse(expression, mode="eval")
        literals: list[int] = []
        value = _evaluate(tree.body, literals)
    except (SyntaxError, _Rejected, ZeroDivisionError, RecursionError, MemoryError, ValueError):
        return 0.0
    if Counter(literals) - Counter(numbers):  # some literal used more often than given
        return 0.0
    return 1.0 if value == target else 0.0
