"""Logic checkers: extraction and normalized / exact matching of SynLogic- and BBH-style answers."""

import pytest

from megatron_rlvr.rewards.logic import verify_logic

CASES = [
    # (gold, response, normalized score, exact score)
    ("(A)", "Let's think step by step. ... So the answer is (A).", 1.0, 1.0),
    ("(A)", "So the answer is A.", 1.0, 0.0),
    ("(A)", "So the answer is (B).", 0.0, 0.0),
    ("(C)", "the answer is option C", 1.0, 0.0),
    ("(C)", "So the answer is (C) 05/01/2021.", 1.0, 0.0),
    ("(C)", "So the answer is (D) 05/01/2021.", 0.0, 0.0),
    ("(B)", "So the answer is B. the red one", 1.0, 0.0),
    ("(A)", "So the answer is apple", 0.0, 0.0),
    ("True", "So the answer is True.", 1.0, 1.0),
    ("True", "So the answer is **true**", 1.0, 0.0),
    ("True", "So the answer is False.", 0.0, 0.0),
    ("valid", "So the answer is invalid.", 0.0, 0.0),
    ("Yes", "So the answer is yes", 1.0, 0.0),
    ("Yes", "So the answer is True", 0.0, 0.0),  # different vocabularies are not conflated
    ("apple banana cherry", "So the answer is apple  banana cherry.", 1.0, 0.0),
    ("] ] )", "So the answer is ] ] ).", 1.0, 1.0),
    ("] ] )", "So the answer is ]])", 1.0, 0.0),
    ("24", "So the answer is 24.", 1.0, 1.0),
    ("[1, 2, 3]", "<answer>[1,2,3]</answer>", 1.0, 0.0),
    ("[1, 2, 3]", "<answer>[1, 2, 3]</answer>", 1.0, 1.0),
    ("[1, 2, 3]", "<answer>[1, 3, 2]</answer>", 0.0, 0.0),
    ("NO", "thinking <answer>maybe</answer> ... final <answer> no </answer>", 1.0, 0.0),
    ("blue", "The final result is \\boxed{\\text{Blue}}", 1.0, 0.0),
    ("4 3 1 2", "reasoning...\n4 3 1 2", 1.0, 1.0),
    ("4 3 1 2", "", 0.0, 0.0),
]


@pytest.mark.parametrize("gold,response,normalized,exact", CASES)
def test_logic_match_table(gold, response, normalized, exact):
    assert verify_logic(response, gold, "normalized") == normalized
    assert verify_logic(response, gold, "exact") == exact


def test_bad_reference_and_mode_are_clear_errors():
    with pytest.raises(ValueError, match="logic reference"):
        verify_logic("x", "")
    with pytest.raises(ValueError, match="logic match mode"):
        verify_logic("x", "y", "fuzzy")
