"""reasoning-gym rows scored by each dataset's own score_answer in the pool's workers: gold answers 1, corrupted
ones 0 (three tasks, rows as `data prepare reasoning-gym` writes them); malformed references and a missing install
are one-line errors before any scoring."""

import json
import sys

import pytest

from megatron_rlvr.data.prepare import main as data_main
from megatron_rlvr.rewards import RewardConfig, RewardPool
from megatron_rlvr.rewards import reasoning_gym as rg_reward

RELATIONS = ("grandfather", "niece")


def corrupt(task: str, gold: str) -> str:
    """A wrong answer each task's scorer gives no partial credit for."""
    if task == "reasoning_gym:leg_counting":
        return str(int(gold) + 1)
    if task == "reasoning_gym:syllogism":
        return {"Yes": "No", "No": "Yes"}[gold]
    return RELATIONS[gold == RELATIONS[0]]  # family_relationships: another relation


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("rg") / "train.jsonl"
    assert (
        data_main(
            [
                "prepare",
                "reasoning-gym",
                "--tasks",
                "leg_counting,syllogism,family_relationships",
                "--size",
                "10",
                "--seed",
                "3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def pool():
    with RewardPool(RewardConfig(workers=2)) as p:
        yield p


def test_gold_answers_score_1_and_corrupted_ones_0_through_the_pool(pool, rows):
    tasks = [r["task"] for r in rows]
    gold = [r["answer"]["answer"] for r in rows]
    responses = [f"Let me think it through.\n<answer>{g}</answer>" for g in gold]
    rewards, counters = pool.score_batch(tasks, responses, [r["answer"] for r in rows])
    assert rewards == [1.0] * len(rows)
    assert counters["errors"] == counters["timeouts"] == counters["crashes"] == 0
    for name in ("leg_counting", "syllogism", "family_relationships"):
        assert counters[f"verifier/reasoning_gym:{name}"] == tasks.count(f"reasoning_gym:{name}") > 0
    wrong = [f"<answer>{corrupt(t, g)}</answer>" for t, g in zip(tasks, gold)]
    rewards, _ = pool.score_batch(tasks, wrong, [r["answer"] for r in rows])
    assert rewards == [0.0] * len(rows)
    # without tags the whole response is the answer, as the demo model writes it
    assert pool.score_batch(tasks[:1], [gold[0]], [rows[0]["answer"]])[0] == [1.0]


def test_bad_rows_and_a_missing_install_are_one_line_errors(pool, rows, monkeypatch):
    with pytest.raises(ValueError, match=r"item 0: reasoning_gym:leg_counting reference: expected the dataset entry"):
        pool.score_batch(["reasoning_gym:leg_counting"], ["4"], ["4"])
    rewards, counters = pool.score_batch(["reasoning_gym:no_such_task"], ["4"], [rows[0]["answer"]])
    assert rewards == [0.0] and counters["errors"] == 1
    assert "reasoning-gym has no dataset 'no_such_task'" in pool.last_errors[0]
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as where it is not installed: imports of it fail
    with pytest.raises(
        rg_reward.ReasoningGymMissingError,
        match=r"^reasoning-gym is not installed \(task "
        r"'reasoning_gym:syllogism'\); pip install ",
    ):
        pool.score_batch(["reasoning_gym:syllogism"], ["Yes"], [rows[0]["answer"]])
