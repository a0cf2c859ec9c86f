"""The countdown demo task: deterministic generator, disjoint splits, many answers per problem, the answer contract."""

from __future__ import annotations

import pytest

from megatron_rlvr.tasks import countdown as task


def test_generator_is_deterministic_in_the_seed():
    a = task.generate(5, 40, "train")
    assert a == task.generate(5, 40, "train")
    assert a != task.generate(6, 40, "train")
    assert len({p.id for p in a}) == 40


def test_splits_are_disjoint():
    train = {(tuple(sorted(p.numbers)), p.target) for p in task.generate(0, 2000, "train")}
    evals = {(tuple(sorted(p.numbers)), p.target) for p in task.generate(0, 200, "eval")}
    assert len(evals) == 200 and not train & evals
    assert all(task.split_of(p.numbers, p.target) == "eval" for p in task.generate(3, 50, "eval"))


def test_every_problem_has_many_correct_answers_that_the_checker_accepts():
    for p in task.generate(1, 30, "eval"):
        assert len(p.numbers) == task.NUM_COUNT and task.TARGET_MIN <= p.target <= task.TARGET_MAX
        sols = task.solutions(p.numbers, p.target)
        assert len(sols) >= task.MIN_SOLUTIONS
        assert all(task.check_solution(s, p.numbers, p.target) for s in sols)
        assert p.prompt == " ".join(map(str, p.numbers)) + f" -> {p.target}:"
        assert p.reference == {"numbers": list(p.numbers), "target": p.target}


@pytest.mark.parametrize(
    "response, ok",
    [
        ("3*7+4", True),
        ("3*7+4\nanything after the first line", True),
        (" (7 + 4*3) - 1 - 1 ", False),  # 1 is not given
        ("(7+3)*4-3*5", False),  # 3 used twice, given once
        ("7*3+4*1", False),
        ("25", False),  # a literal that is not given
        ("21+4", False),
        ("3*7+4=25", False),  # only an expression
        ("-3+7*4", False),  # unary minus is not part of the contract's language
        ("", False),
        ("4*(7+3)-3*5", False),
        ("4*(9-3)+1", False),
        ("(4+9/3)*3+4", False),
    ],
)
def test_check_solution_contract(response, ok):
    numbers, target = [3, 7, 4, 9], 25
    assert task.check_solution(response, numbers, target) is ok


def test_rational_intermediates_count_and_repeated_numbers_may_be_used_as_often_as_given():
    assert task.check_solution("(1+1/2)*4", [1, 2, 4, 1], 6)  # exact 3/2 intermediate
    assert task.check_solution("9+9+9+1", [1, 9, 9, 9], 28)
    assert not task.check_solution("9+9+9+9+1", [1, 9, 9, 9], 37)
    assert not task.check_solution("7/0", [7, 0], 7)
