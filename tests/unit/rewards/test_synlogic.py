"""SynLogic's official verifiers through reward.synlogic_dir, with a stand-in checkout of two tasks made here: rows
prepared by `data prepare synlogic` are scored by their task's verifier in the pool's workers (answers the generic
matcher gets wrong included); other logic rows follow reward.logic_fallback; the rows per verifier are counted."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.data.prepare import main as data_main
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.rewards import RewardConfig, RewardPool
from megatron_rlvr.rewards.synlogic import SynLogicVerifiers
from megatron_rlvr.rewards.verifiers import VerifierTable
from tests.unit.rewards.synlogic_standin import make_checkout


def release_row(task, question, answer, metadata):
    game = {"question": question, "answer": answer, "difficulty": 3, "metadata": metadata, "gpt_response": ""}
    return {
        "data_source": task,
        "prompt": [{"role": "user", "content": question}],
        "ability": "logic",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": 0, "game_data_str": json.dumps(game)},
    }


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return make_checkout(tmp_path_factory.mktemp("standin") / "SynLogic")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The rows' references as `data prepare synlogic` writes them from a release in SynLogic's layout."""
    src = tmp_path_factory.mktemp("release") / "SynLogic"
    (src / "synlogic_easy").mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist(
            [
                release_row(
                    "word_sorting", "Sort: pear apple fig", "apple, fig, pear", {"words": ["pear", "apple", "fig"]}
                ),
                release_row(
                    "game_of_24", "Make 24 from 8 4 7 1", "(8-4)*(7-1)", {"numbers": [8, 4, 7, 1], "result": 24}
                ),
                release_row("zebra_puzzle", "Who owns the fish?", "the german", {"houses": 5}),
            ]
        ),
        src / "synlogic_easy" / "train.parquet",
    )
    out = src.parent / "train.jsonl"
    assert data_main(["prepare", "synlogic", "--src", str(src), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {row["answer"]["data_source"]: row["answer"] for row in rows}


@pytest.fixture(scope="module")
def pool(checkout):
    cfg = load_config(None, [f"reward.synlogic_dir={checkout}", "reward.workers=1"])
    with RewardPool(cfg.reward) as p:
        yield p


def test_prepare_keeps_what_the_verifiers_need(references):
    ref = references["game_of_24"]
    assert ref == {
        "data_source": "game_of_24",
        "answer": "(8-4)*(7-1)",
        "metadata": {"numbers": [8, 4, 7, 1], "result": 24},
        "question": "Make 24 from 8 4 7 1",
        "difficulty": 3,
    }


def test_task_verifiers_score_their_rows_and_the_rest_fall_back(pool, references):
    sort, game, zebra = references["word_sorting"], references["game_of_24"], references["zebra_puzzle"]
    cases = [  # (reference, response, official verifier's reward)
        (sort, "<answer>apple fig pear</answer>", 1.0),  # the gold string is "apple, fig, pear"
        (sort, "<answer>apple, fig, pear</answer>", 1.0),
        (sort, "<answer>fig apple pear</answer>", 0.0),
        (game, "<answer>(7-1)*(8-4)</answer>", 1.0),  # another right expression than the gold's
        (game, "<answer>(8-4)*(7-1)</answer>", 1.0),
        (game, "<answer>8*4-7+1</answer>", 0.0),
    ]
    fallback = [
        (zebra, "<answer>The German</answer>", 1.0),
        (zebra, "<answer>the swede</answer>", 0.0),
        ("the german", "So the answer is the German.", 1.0),
    ]  # a string reference: the generic matcher
    refs, responses, expected = zip(*(cases + fallback))
    rewards, counters = pool.score_batch(["logic"] * len(refs), responses, refs)
    assert rewards == list(expected)
    assert counters["verifier/synlogic:word_sorting"] == 3 and counters["verifier/synlogic:game_of_24"] == 3
    assert counters["verifier/logic"] == 3 and counters["errors"] == counters["crashes"] == 0
    # the generic matcher alone gets the two reformatted right answers wrong
    generic = VerifierTable(RewardConfig())
    assert [generic.score("logic", "logic", cases[i][1], cases[i][0]) for i in (0, 3)] == [0.0, 0.0]


def test_without_fallback_a_row_with_no_official_verifier_is_an_error_naming_it(checkout, references):
    table = VerifierTable(RewardConfig(synlogic_dir=str(checkout), logic_fallback=False))
    assert table.route("logic", references["game_of_24"]) == "synlogic:game_of_24"
    with pytest.raises(
        ValueError,
        match=r"data_source 'zebra_puzzle': no official SynLogic verifier .*"
        r"reward\.logic_fallback=false",
    ):
        table.route("logic", references["zebra_puzzle"])
    with pytest.raises(ValueError, match=r"data_source None: .*reward\.logic_fallback"):
        table.route("logic", "the german")


def test_verifiers_print_nothing_to_the_console(checkout, references, capsys):
    verifiers = SynLogicVerifiers.load(str(checkout))
    assert verifiers.tasks == {"word_sorting", "game_of_24"}
    assert verifiers.verify("game_of_24", "<answer>(7-1)*(8-4)</answer>", references["game_of_24"]) == 1.0
    assert capsys.readouterr() == ("", "")


def test_an_unusable_checkout_is_a_one_line_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"reward\.synlogic_dir: .*nowhere is not a directory"):
        load_config(None, [f"reward.synlogic_dir={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match=r"reward\.synlogic_dir: .* has no task2verifier\.py"):
        load_config(None, [f"reward.synlogic_dir={tmp_path}"])
    (tmp_path / "task2verifier.py").write_text("import nltk_is_not_installed_here\n")
    with pytest.raises(
        ConfigError,
        match=r"reward\.synlogic_dir: importing .*task2verifier\.py failed: "
        r"ModuleNotFoundError: .*pip install -r .*requirements\.txt",
    ) as info:
        load_config(None, [f"reward.synlogic_dir={tmp_path}"])
    assert "\n" not in str(info.value)
