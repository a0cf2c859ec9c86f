"""The embedded demo task: countdown, "reach the target with these numbers", many correct answers per prompt.

Format contract (the ``countdown`` verifier in ``megatron_rlvr.rewards`` checks exactly this):

- prompt text: the numbers then the target, e.g. ``"3 7 4 9 -> 31:"`` (see :func:`format_prompt`);
- reference: ``{"numbers": [ints], "target": int}``;
- a response is correct when its first line is an arithmetic expression over integer literals with ``+ - * /`` and
  parentheses, every literal one of the given numbers, each used at most as many times as it is given (not all
  must be used), evaluating exactly (rational arithmetic) to the target. Unary minus is not part of the language.

Problems come from a seeded generator; a problem's split (train / eval) is a pure function of its content, so the
splits are disjoint whatever the seed. The verifier is ``megatron_rlvr.rewards.countdown`` (:func:`check_solution`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

Split = Literal["train", "eval"]

# Difficulty. A warm-started tiny model should solve some but not all of these (see tools/reports/make_demo_model.py).
NUM_COUNT = 4  # numbers given per problem
NUM_MIN, NUM_MAX = 1, 9  # each number is drawn from this range (repeats allowed)
TARGET_MIN, TARGET_MAX = 10, 40  # targets are reachable values inside this range
MIN_SOLUTIONS = 12  # a target is kept only if it has at least this many distinct solutions: many ways to be right
EVAL_FRACTION_PER_MILLE = 100  # ~10% of all possible problems belong to the eval split


@dataclass(frozen=True)
class CountdownProblem:
    numbers: tuple[int, ...]
    target: int
    id: str = field(default="")

    @property
    def prompt(self) -> str:
        return format_prompt(self.numbers, self.target)

    @property
    def reference(self) -> dict:
        return {"numbers": list(self.numbers), "target": self.target}


def format_prompt(numbers: tuple[int, ...] | list[int], target: int) -> str:
    return f"{' '.join(str(n) for n in numbers)} -> {target}:"


def problem_id(numbers: tuple[int, ...], target: int) -> str:
    return "countdown-" + "-".join(str(n) for n in numbers) + f"-t{target}"


def split_of(numbers: tuple[int, ...], target: int) -> Split:
    """The split is a hash of the problem's content (order-insensitive), so train and eval never share a problem."""
    key = ",".join(str(n) for n in sorted(numbers)) + f"->{target}"
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % 1000
    return "eval" if bucket < EVAL_FRACTION_PER_MILLE else "train"


# ---------------------------------------------------------------------------------------------------------------
# Solutions: every expression over a sub-multiset of the numbers, with integer, non-negative intermediates


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3


def _render(op: str, left: tuple[str, int], right: tuple[str, int]) -> str:
    """Minimal parentheses that keep the tree's value when the string is read with the usual precedence."""
    p = _PRECEDENCE[op]
    ls = f"({left[0]})" if left[1] < p else left[0]
    needs = right[1] < p or (right[1] == p and op in "-/")
    rs = f"({right[0]})" if needs else right[0]
    return f"{ls}{op}{rs}"


def _expressions(numbers: tuple[int, ...], cap: int) -> dict[int, dict[int, dict[str, int]]]:
    """For each index mask: value -> {expression: precedence}, at most ``cap`` expressions per value."""
    n = len(numbers)
    table: dict[int, dict[int, dict[str, int]]] = {}
    for i, x in enumerate(numbers):
        table[1 << i] = {x: {str(x): _ATOM}}
    for mask in range(1, 1 << n):
        if mask in table:
            continue
        out: dict[int, dict[str, int]] = {}
        sub = (mask - 1) & mask
        while sub:
            rest = mask ^ sub
            for a, a_exprs in table[sub].items():
                for b, b_exprs in table[rest].items():
                    for op in "+-*/":
                        if op == "-" and a - b < 0:
                            continue
                        if op == "/" and (b == 0 or a % b != 0):
                            continue
                        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
                        bucket = out.setdefault(value, {})
                        if len(bucket) >= cap:
                            continue
                        for ea, pa in a_exprs.items():
                            for eb, pb in b_exprs.items():
                                if len(bucket) >= cap:
                                    break
                                bucket.setdefault(_render(op, (ea, pa), (eb, pb)), _PRECEDENCE[op])
            sub = (sub - 1) & mask
        table[mask] = out
    return table


def reference_solution(reference: object) -> str | None:
    """The first solver expression of a countdown reference ``{"numbers": [...], "target": n}`` (what the
    privileged context and SFT's demonstrations show of a row); None when it is not one or has no solution."""
    if not (isinstance(reference, dict) and "numbers" in reference and "target" in reference):
        return None
    found = solutions(tuple(reference["numbers"]), int(reference["target"]))
    return found[0] if found else None


def solutions(numbers: tuple[int, ...] | list[int], target: int, cap: int = 256) -> list[str]:
    """Distinct solution strings for ``target`` (sorted, at most about ``cap`` per sub-multiset of the numbers)."""
    table = _expressions(tuple(numbers), cap)
    found: set[str] = set()
    for by_value in table.values():
        found.update(by_value.get(target, {}))
    return sorted(e for e in found if not e.isdigit())  # a bare given number is not an answer


def reachable_targets(numbers: tuple[int, ...], cap: int) -> dict[int, int]:
    """target -> distinct solutions found (at most about ``cap`` per sub-multiset), for targets in
    [TARGET_MIN, TARGET_MAX] that need 2 or more numbers. A small cap keeps the generator fast: it only has to
    tell whether a target has at least MIN_SOLUTIONS answers."""
    table = _expressions(numbers, cap=cap)
    seen: dict[int, set[str]] = {}
    for mask, by_value in table.items():
        if bin(mask).count("1") < 2:
            continue
        for value, exprs in by_value.items():
            if TARGET_MIN <= value <= TARGET_MAX:
                seen.setdefault(value, set()).update(exprs)
    return {value: len(exprs) for value, exprs in seen.items()}


# ---------------------------------------------------------------------------------------------------------------
# Generator


def generate(seed: int, count: int, split: Split) -> list[CountdownProblem]:
    """``count`` distinct problems of ``split``, deterministic in ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split: expected 'train' or 'eval', got {split!r}")
    return list(_take(iter_problems(seed, split), count))


def iter_problems(seed: int, split: Split) -> Iterator[CountdownProblem]:
    rng = random.Random(f"countdown:{seed}")
    seen: set[tuple[tuple[int, ...], int]] = set()
    misses = 0  # consecutive draws that gave no new problem: the split is (nearly) exhausted
    while True:
        numbers = tuple(rng.randint(NUM_MIN, NUM_MAX) for _ in range(NUM_COUNT))
        targets = {t: c for t, c in reachable_targets(numbers, cap=MIN_SOLUTIONS).items() if c >= MIN_SOLUTIONS}
        key = tuple(sorted(numbers))  # the same numbers in another order are the same problem
        candidates = sorted(t for t in targets if split_of(numbers, t) == split and (key, t) not in seen)
        if not candidates:
            misses += 1
            if misses > 2_000:
                raise RuntimeError(
                    f"countdown generator: no new {split} problems after {len(seen)} (the {split} split holds only "
                    f"about that many with these difficulty settings); ask for fewer"
                )
            continue
        misses = 0
        target = rng.choice(candidates)
        seen.add((key, target))
        yield CountdownProblem(numbers, target, problem_id(numbers, target))


def _take(it: Iterator[CountdownProblem], count: int) -> Iterator[CountdownProblem]:
    for _, item in zip(range(count), it):
        yield item


# ---------------------------------------------------------------------------------------------------------------
# The contract is the rewards package's countdown verifier: one definition of "correct"


def check_solution(response: str, numbers: list[int] | tuple[int, ...], target: int) -> bool:
    """True when the response's first line is a valid expression over the numbers that equals the target."""
    from megatron_rlvr.rewards.countdown import score_countdown

    return score_countdown(response, {"numbers": list(numbers), "target": target}) == 1.0
