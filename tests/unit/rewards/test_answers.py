"""reward.answer: how a response's final answer is read for reasoning-gym's score_answer. tagged is
reasoning-gym's own extract_answer (else the whole response), last_number the last plain number, boxed the last
balanced \\boxed{}; each option end to end through the pool on basic_arithmetic rows, and a bad value is a one-line
config error."""

from __future__ import annotations

import json

import pytest

from megatron_rlvr.rewards.answers import last_boxed, last_number, read_answer, tagged


@pytest.mark.parametrize(
    "text",
    [
        "<answer>42</answer>",
        "x <answer> 7 </answer> then <answer>\n-3\n</answer> end",
        "<answer></answer>",
        "<answer>a\nb</answer>",
        "no tags at all",
        "<answer>open only",
    ],
)
def test_tagged_is_reasoning_gyms_extract_answer(text):
    from reasoning_gym.utils import extract_answer

    assert tagged(text) == extract_answer(text)


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("5 - 3 = 2.", "2"),
        ("The result of -5 * 1 is -5", "-5"),
        ("3 + 4 is 7, and 1,234 apples", "1234"),
        ("it is 2.50 dollars.", "2.50"),
        ("x = 12, y = 3-4", "-4"),  # a minus sign right before digits belongs to the number
        ("the answer is –5", "5"),  # an en dash is not a minus sign
        ("no digits here", None),
        ("1,23 and 12,3456", "3456"),  # commas that are not thousands separators split numbers
    ],
)
def test_last_number(text, number):
    assert last_number(text) == number


def test_last_boxed_and_the_formats():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and then \boxed{3}") == "3"
    assert last_boxed(r"\boxed{x^{2}} end") == "x^{2}"
    assert last_boxed(r"cut off \boxed{12") == "" and last_boxed("none") is None
    response = "Let me see: 2 + 3 = 5. <answer>6</answer> \\boxed{7} and 8"
    assert read_answer(response, "tagged") == "6"
    assert read_answer("  just 9 \n", "tagged") == "just 9"  # no tags: the whole response, stripped
    assert read_answer(response, "last_number") == "8"
    assert read_answer(response, "boxed") == "7"
    assert read_answer("nothing", "last_number") == read_answer("nothing", "boxed") == ""
    with pytest.raises(ValueError, match=r"reward.answer: expected one of \['tagged', 'last_number', 'boxed'\]"):
        read_answer(response, "first_number")


@pytest.fixture(scope="module")
def arithmetic_rows(tmp_path_factory):
    from megatron_rlvr.data.prepare import main as data_main

    out = tmp_path_factory.mktemp("rg") / "rows.jsonl"
    config = ["min_terms=2", "max_terms=2", "min_digits=1", "max_digits=1"]
    args = ["prepare", "reasoning-gym", "--tasks", "basic_arithmetic", "--size", "6", "--seed", "7", "--no-instruction"]
    assert data_main([*args, *(f"--config=basic_arithmetic.{c}" for c in config), "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("answer", ["tagged", "last_number", "boxed"])
def test_each_format_scores_chat_answers_through_the_pool(arithmetic_rows, answer):
    from megatron_rlvr.rewards import RewardConfig, RewardPool

    rows = arithmetic_rows
    gold = [r["answer"]["answer"] for r in rows]
    written = {
        "tagged": [f"Sure. <answer>{g}</answer> (checked 100 ways)" for g in gold],
        "last_number": [f"{r['problem'][len('Calculate ') : -1]} = {g}." for r, g in zip(rows, gold)],
        "boxed": [f"The result is $\\boxed{{{g}}}$, after 100 tries." for g in gold],
    }
    with RewardPool(RewardConfig(workers=1, answer=answer)) as pool:
        tasks, refs = [r["task"] for r in rows], [r["answer"] for r in rows]
        rewards, counters = pool.score_batch(tasks, written[answer], refs)
        assert rewards == [1.0] * len(rows) and counters["errors"] == 0
        others = [f for f in written if f != answer]
        for other in others:  # another format's answers are read as something else: never fully right
            scored, _ = pool.score_batch(tasks, written[other], refs)
            assert all(s < 1.0 for s in scored), (answer, other, scored)


def test_a_bad_answer_format_is_a_config_error_naming_the_key():
    from megatron_rlvr.config import load_config
    from megatron_rlvr.errors import ConfigError

    assert load_config(None, ["reward.answer=last_number"]).reward.answer == "last_number"
    with pytest.raises(ConfigError, match="reward.answer"):
        load_config(None, ["reward.answer=first_number"])
