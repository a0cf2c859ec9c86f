"""`data prepare reasoning-gym`: rows generated from a seed (the same seed, the same rows), each keeping its entry's
answer and metadata under the task reasoning_gym:NAME; bad task names, config fields and flags are one-line errors,
and a missing install says how to install it."""

import json
import sys

import pytest

from megatron_rlvr.data.prepare import main
from megatron_rlvr.data.sources import DataError
from megatron_rlvr.rewards import reasoning_gym as rg_reward

TASKS = "leg_counting,syllogism,family_relationships"


def prepare(tmp_path, name, *extra):
    out = tmp_path / f"{name}.jsonl"
    assert main(["prepare", "reasoning-gym", "--tasks", TASKS, "--size", "12", "--out", str(out), *extra]) == 0
    return out


def test_three_tasks_from_a_seed_and_the_same_seed_gives_the_same_rows(tmp_path, capsys):
    first = prepare(tmp_path, "a", "--seed", "5")
    again = prepare(tmp_path, "b", "--seed", "5")
    other = prepare(tmp_path, "c", "--seed", "6")
    assert first.read_bytes() == again.read_bytes()
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    other_rows = [json.loads(line) for line in other.read_text().splitlines()]
    assert {r["task"] for r in rows} == {f"reasoning_gym:{n}" for n in TASKS.split(",")}
    assert [r["problem"] for r in rows] != [r["problem"] for r in other_rows]
    import reasoning_gym

    for name in TASKS.split(","):
        mine = [r for r in rows if r["task"] == f"reasoning_gym:{name}"]
        entries = reasoning_gym.create_dataset(name, size=12, seed=5)
        for row in mine:  # each row is its entry: question, gold answer and metadata as generated
            index = int(row["id"].rsplit("-", 1)[1])
            entry = entries[index]
            assert row["problem"].startswith(entry["question"]) and "<answer>" in row["problem"]
            assert row["answer"]["answer"] == entry["answer"]
            assert row["answer"]["metadata"] == json.loads(json.dumps(entry["metadata"]))
        assert 1 <= len(mine) <= 12  # repeated questions (syllogisms repeat) are kept once
    assert "reasoning-gym leg_counting,syllogism,family_relationships (seed 6)" in capsys.readouterr().out


def test_disjoint_from_drops_the_held_out_questions_by_exact_text(tmp_path):
    held_out = prepare(tmp_path, "held_out", "--seed", "5")
    # the same seed: every question is held out (with or without the answer instruction), so nothing is left
    with pytest.raises(DataError, match=r"no usable rows \(generated 36 entries; 36 dropped as held out"):
        prepare(tmp_path, "train", "--seed", "5", "--disjoint-from", str(held_out), "--no-instruction")
    other = prepare(tmp_path, "other", "--seed", "300", "--disjoint-from", str(held_out))
    questions = {json.loads(line)["problem"] for line in held_out.read_text().splitlines()}
    kept = [json.loads(line)["problem"] for line in other.read_text().splitlines()]
    assert kept and not questions & set(kept)
    with pytest.raises(DataError, match=r"--disjoint-from .*nope.jsonl: cannot read it"):
        prepare(tmp_path, "x", "--seed", "1", "--disjoint-from", str(tmp_path / "nope.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: not a row of `data prepare reasoning-gym`"):
        prepare(tmp_path, "y", "--seed", "1", "--disjoint-from", str(tmp_path / "bad.jsonl"))


def test_a_config_field_reaches_the_generator(tmp_path):
    out = tmp_path / "legs.jsonl"
    main(
        [
            "prepare",
            "reasoning-gym",
            "--tasks",
            "leg_counting",
            "--size",
            "8",
            "--seed",
            "1",
            "--out",
            str(out),
            "--config",
            "leg_counting.min_animals=2",
            "--config",
            "leg_counting.max_animals=2",
            "--no-instruction",
        ]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(len(r["answer"]["metadata"]["animals"]) == 2 for r in rows)
    assert all("<answer>" not in r["problem"] for r in rows)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--tasks", "leg_countin", "--size", "2", "--seed", "1"],
            r"--tasks: reasoning-gym has no dataset 'leg_countin'; "
            r"did you mean leg_counting",
        ),
        (["--tasks", "syllogism", "--size", "2"], r"reasoning-gym: give --seed"),
        (["--tasks", "syllogism", "--size", "0", "--seed", "1"], r"--size 0: expected the number of rows per task"),
        (
            ["--tasks", "syllogism", "--size", "2", "--seed", "1", "--config", "syllogism.no_such_field=1"],
            r"--config syllogism: .*no_such_field",
        ),
        (
            ["--tasks", "syllogism", "--size", "2", "--seed", "1", "--config", "countdown.max_numbers=3"],
            r"--config 'countdown.max_numbers=3': 'countdown' is not one of --tasks",
        ),
        (
            ["--tasks", "syllogism", "--size", "2", "--seed", "1", "--src", "somewhere"],
            r"--src: not with reasoning-gym",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(tmp_path, args, message):
    with pytest.raises(DataError, match=message) as info:
        main(["prepare", "reasoning-gym", "--out", str(tmp_path / "x.jsonl"), *args])
    assert "\n" not in str(info.value)


def test_gym_flags_on_another_release_and_a_missing_install_are_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"--tasks, --seed: only with `data prepare reasoning-gym`"):
        main(
            [
                "prepare",
                "gsm8k",
                "--src",
                str(tmp_path),
                "--out",
                str(tmp_path / "x.jsonl"),
                "--tasks",
                "a",
                "--seed",
                "1",
            ]
        )
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as where it is not installed: imports of it fail
    with pytest.raises(
        rg_reward.ReasoningGymMissingError,
        match=r"^reasoning-gym is not installed \(data prepare "
        r"reasoning-gym\); pip install 'megatron-rlvr\[tasks\]'",
    ):
        main(
            [
                "prepare",
                "reasoning-gym",
                "--tasks",
                "syllogism",
                "--size",
                "2",
                "--seed",
                "1",
                "--out",
                str(tmp_path / "x.jsonl"),
            ]
        )
