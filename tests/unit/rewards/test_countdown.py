"""The countdown verifier: the contract the demo's generator relies on."""

import pytest

from megatron_rlvr.rewards.countdown import score_countdown

REF = {"numbers": [3, 5, 7, 7], "target": 24}


@pytest.mark.parametrize(
    "response",
    [
        "(7+5)*(7-5)",  # 5 used twice, one given
        "3*7+3",  # 3 used twice
        "3*(5+7)-7-5",  # 5 twice
        "5*7-7-3-1",  # 1 is not given
    ],
)
def test_multiset_violations_score_zero(response):
    assert score_countdown(response, REF) == 0.0


@pytest.mark.parametrize(
    "response",
    [
        "3 * 5 + 7 + 7 - 5 + 0",  # 0 not given
        "(7*7 - 1)/2",
        "",
        "\n3*(5+7)",  # the first line is empty
        "24",  # a literal that is not given
        "3**2",
        "7//3",
        "-3+27",
        "7/(5-5)",
        "7/(7-7)*3",
        "3 + five",
        "import os",
        "__import__('os').system('true')",
        "(" * 101 + "3" + ")" * 101,  # over 200 characters
        "03*8",
        "3.0*8",
        "3e1",
        "7+7+5+3+2",
    ],
)
def test_rejected_responses_score_zero(response):
    assert score_countdown(response, REF) == 0.0


@pytest.mark.parametrize(
    "response,reference",
    [
        ("(7-5)*(7+5)", {"numbers": [3, 5, 7, 7, 5], "target": 24}),
        ("3*(7+7-5) - 3", {"numbers": [3, 3, 7, 7, 5], "target": 24}),
        ("7 * 3 + 3\nbecause 21 + 3 = 24", {"numbers": [7, 3, 3], "target": 24}),  # only the first line counts
        ("  3*7+7-5-7+5+3  ", {"numbers": [3, 3, 7, 7, 7, 5, 5], "target": 24}),
        ("(3 + 5) * 3", {"numbers": [3, 5, 3, 9], "target": 24}),  # a sub-multiset: 9 unused
        ("7/7*24", {"numbers": [7, 7, 24], "target": 24}),
        ("(1/3)*72", {"numbers": [1, 3, 72], "target": 24}),  # exact fractions, no float rounding
        ("100/3*3 - 76", {"numbers": [100, 3, 3, 76], "target": 24}),
        ("0*5+24", {"numbers": [0, 5, 24], "target": 24}),
    ],
)
def test_valid_expressions_score_one(response, reference):
    assert score_countdown(response, reference) == 1.0


@pytest.mark.parametrize(
    "reference", [None, [1, 2], {"numbers": [1, 2]}, {"numbers": "12", "target": 3}, {"numbers": [1], "target": 2.5}]
)
def test_malformed_reference_is_a_clear_error(reference):
    with pytest.raises(ValueError, match="countdown reference"):
        score_countdown("1+2", reference)
