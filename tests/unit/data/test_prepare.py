"""`megatron-rlvr data prepare`: each release read in its real layout (a few rows made here), rows without an answer
counted and skipped (or an error naming the row), the overlap check against eval benchmark files."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rlvr.data import DataConfig, read_rows
from megatron_rlvr.data.prepare import main, parse_levels
from megatron_rlvr.data.sources import DataError

BOX = "\\boxed"


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_parquet(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def out_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def make_math_tarball(root: Path) -> Path:
    """hendrycks MATH as released: MATH/{train,test}/<subject>/<n>.json."""
    math = root / "MATH"
    write_json(
        math / "train" / "algebra" / "1.json",
        {"problem": "Solve $x+1=3$.", "level": "Level 3", "type": "Algebra", "solution": f"So $x = {BOX}{{2}}$."},
    )
    write_json(
        math / "train" / "algebra" / "2.json",
        {"problem": "What is $1+1$?", "level": "Level 1", "type": "Algebra", "solution": f"It is {BOX}{{2}}."},
    )
    write_json(
        math / "train" / "geometry" / "7.json",
        {
            "problem": "Find the area of a unit square.",
            "level": "Level 5",
            "type": "Geometry",
            "solution": f"Area {BOX}{{\\frac{{1}}{{1}}}} and then {BOX}{{1}}.",
        },
    )
    write_json(
        math / "train" / "geometry" / "8.json",
        {
            "problem": "A problem whose solution lost its box.",
            "level": "Level 4",
            "type": "Geometry",
            "solution": "The answer is 4.",
        },
    )
    write_json(
        math / "train" / "precalculus" / "3.json",
        {"problem": "Odd level.", "level": "Level ?", "type": "Precalculus", "solution": f"{BOX}{{0}}"},
    )
    write_json(
        math / "test" / "algebra" / "5.json",
        {"problem": "A test problem.", "level": "Level 3", "type": "Algebra", "solution": f"{BOX}{{9}}"},
    )
    return math


def test_math_tarball_levels_3_to_5_with_the_last_boxed_answer(tmp_path, capsys):
    src = make_math_tarball(tmp_path)
    out = tmp_path / "math_l3to5" / "train.jsonl"
    assert main(["prepare", "math", "--src", str(src), "--levels", "3-5", "--out", str(out)]) == 0
    rows = out_rows(out)
    assert [(r["answer"], r["task"], r["source"]) for r in rows] == [("2", "math", "math"), ("1", "math", "math")]
    assert rows[0]["problem"].startswith("Solve $x+1=3$.") and "\\boxed{}" in rows[0]["problem"]
    assert all(r["id"].startswith("math-") for r in rows) and len({r["id"] for r in rows}) == 2
    printed = capsys.readouterr().out
    assert "read 5 records" in printed  # the test split is not read
    assert "skipped 1: no \\boxed{} answer in 'solution' (first: " in printed and "8.json" in printed
    assert "skipped 1: level 1 not in --levels" in printed and "skipped 1: level 'Level ?' is not a number" in printed
    # the rows are what data/ reads
    from megatron_rlvr.data.dataset import _fields

    fields = [_fields(r, DataConfig()) for r in read_rows(out)]
    assert fields[0][1:3] == ("2", "math")


def test_math_hf_parquet_layout_and_strict_names_the_row(tmp_path):
    src = tmp_path / "hendrycks_math"
    write_parquet(
        src / "algebra" / "train-00000-of-00001.parquet",
        [
            {"problem": "P1", "level": "Level 3", "type": "Algebra", "solution": f"{BOX}{{3}}"},
            {"problem": "P2", "level": "Level 4", "type": "Algebra", "solution": "no box"},
        ],
    )
    write_parquet(
        src / "algebra" / "test-00000-of-00001.parquet",
        [{"problem": "T1", "level": "Level 3", "type": "Algebra", "solution": f"{BOX}{{3}}"}],
    )
    out = tmp_path / "out.jsonl"
    assert main(["prepare", "math", "--src", str(src), "--out", str(out), "--no-instruction"]) == 0
    assert [(r["problem"], r["answer"]) for r in out_rows(out)] == [("P1", "3")]
    with pytest.raises(DataError, match=r"train-00000-of-00001.parquet:row 2: math row skipped: no \\boxed\{\} answer"):
        main(["prepare", "math", "--src", str(src), "--out", str(out), "--strict"])


def test_gsm8k_with_math_level_1_added(tmp_path, capsys):
    gsm = tmp_path / "grade_school_math" / "data"
    write_jsonl(
        gsm / "train.jsonl",
        [
            {"question": "Tom has 3 apples and buys 1,000 more. How many?", "answer": "3 + 1000 = 1003\n#### 1,003"},
            {"question": "A row without the final answer.", "answer": "It is 5."},
        ],
    )
    write_jsonl(gsm / "test.jsonl", [{"question": "Test q", "answer": "#### 1"}])
    math = make_math_tarball(tmp_path)
    out = tmp_path / "gsm8k_math_l1.jsonl"
    assert (
        main(
            [
                "prepare",
                "gsm8k",
                "--src",
                str(gsm.parent),
                "--add",
                "math",
                "--add-src",
                str(math),
                "--levels",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = out_rows(out)
    assert [(r["source"], r["answer"]) for r in rows] == [("gsm8k", "1003"), ("math", "2")]
    assert "skipped 1: no '#### <answer>' in 'answer'" in capsys.readouterr().out
    with pytest.raises(DataError, match="--add math: give that release's directory with --add-src"):
        main(["prepare", "gsm8k", "--src", str(gsm), "--add", "math", "--out", str(out)])
    with pytest.raises(DataError, match="--levels: only the math release has levels"):
        main(["prepare", "gsm8k", "--src", str(gsm), "--levels", "1", "--out", str(out)])
    with pytest.raises(DataError, match="--levels '6': MATH levels are 1 to 5"):
        parse_levels("6")


DAPO_HEAD = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'


def dapo_row(problem, answer, index):
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_HEAD + problem + DAPO_TAIL, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def test_dapo_unwraps_the_prompt_and_keeps_repeated_problems_once(tmp_path, capsys):
    src = tmp_path / "DAPO-Math-17k"
    write_parquet(
        src / "data" / "dapo-math-17k.parquet",
        [
            dapo_row("How many primes are below 10?", "4", "a1"),
            dapo_row("How many primes are below 10?", "4", "a1"),  # the release repeats each problem many times
            dapo_row("What is 2+2?", "", "a2"),
        ],
    )
    out = tmp_path / "dapo.jsonl"
    assert main(["prepare", "dapo-math-17k", "--src", str(src), "--out", str(out), "--no-instruction"]) == 0
    assert out_rows(out) == [
        {
            "id": "dapo-math-17k-a1",
            "problem": "How many primes are below 10?",
            "answer": "4",
            "task": "math",
            "source": "dapo-math-17k",
        }
    ]
    printed = capsys.readouterr().out
    assert "1 repeated problems kept once" in printed and "skipped 1: no 'reward_model.ground_truth'" in printed


def test_synlogic_easy_and_hard_train_files(tmp_path, capsys):
    src = tmp_path / "SynLogic"

    def row(task, q, gt):
        return {
            "data_source": task,
            "prompt": [{"role": "user", "content": q}],
            "ability": "logic",
            "reward_model": {"ground_truth": gt, "style": "rule"},
            "extra_info": {"index": 0},
        }

    write_parquet(src / "synlogic_easy" / "train.parquet", [row("arrow_maze", "Which way?", "left")])
    write_parquet(src / "synlogic_easy" / "validation.parquet", [row("arrow_maze", "Validation q", "up")])
    write_parquet(
        src / "synlogic_hard" / "train.parquet",
        [row("dyck", "Close the brackets: ((", "))"), row("dyck", "No answer here", "")],
    )
    out = tmp_path / "synlogic.jsonl"
    assert main(["prepare", "synlogic", "--src", str(src), "--out", str(out)]) == 0
    assert [(r["problem"], r["answer"]["answer"], r["answer"]["data_source"], r["task"]) for r in out_rows(out)] == [
        ("Which way?", "left", "arrow_maze", "logic"),
        ("Close the brackets: ((", "))", "dyck", "logic"),
    ]
    assert "skipped 1: no answer" in capsys.readouterr().out


def test_deepcoder_stdin_and_functional_tests_become_verifier_references(tmp_path, capsys):
    from megatron_rlvr.rewards.code import check_code_reference

    src = tmp_path / "DeepCoder-Preview-Dataset"
    write_parquet(
        src / "lcbv5" / "train-00000-of-00001.parquet",
        [
            {
                "problem": "Read n and print n+1.",
                "starter_code": "",
                "metadata": "{}",
                "tests": json.dumps([{"input": "1\n", "output": "2\n", "testtype": "stdin"}]),
            },
            {
                "problem": "Implement add.",
                "starter_code": "class Solution:\n    def add(self, a, b):\n",
                "metadata": json.dumps({"func_name": "add"}),
                "tests": json.dumps([{"input": "1\n2", "output": "3", "testtype": "functional"}]),
            },
        ],
    )
    write_parquet(
        src / "primeintellect" / "train-00000-of-00001.parquet",
        [
            {
                "problem": "Call-based.",
                "starter_code": "",
                "metadata": "{}",
                "tests": json.dumps([{"type": "function_call", "fn_name": "f", "input": [1], "output": [2]}]),
            },
            {"problem": "No tests.", "starter_code": "", "metadata": "{}", "tests": "[]"},
        ],
    )
    out = tmp_path / "code.jsonl"
    assert main(["prepare", "deepcoder", "--src", str(src), "--out", str(out)]) == 0
    rows = out_rows(out)
    assert rows[0]["answer"] == {"io": [{"input": "1\n", "output": "2\n"}]} and rows[0]["task"] == "code"
    assert "assert _solution.add(*[1, 2]) == 3" in rows[1]["answer"]["tests"]
    for r in rows:
        check_code_reference(r["answer"])
    printed = capsys.readouterr().out
    assert "skipped 1: test type ['function_call'] has no harness" in printed and "skipped 1: no test cases" in printed


def test_overlap_with_eval_benchmarks_is_reported_and_dropped(tmp_path, capsys):
    src = make_math_tarball(tmp_path)
    evals = tmp_path / "eval_data"
    write_jsonl(
        evals / "math500.jsonl",
        [
            {"unique_id": "test/algebra/9.json", "problem": "Solve  $x + 1 = 3$ .", "answer": "2"},  # spacing differs
            {"unique_id": "test/geometry/1.json", "problem": "Something else entirely.", "answer": "0"},
        ],
    )
    write_jsonl(evals / "aime24.jsonl", [{"id": 1, "problem": "Find the area of a unit square.", "answer": "1"}])
    dapo = tmp_path / "dapo"
    write_parquet(
        dapo / "data" / "dapo-math-17k.parquet",
        [
            dapo_row(
                "Let n be an integer with the stated property; find the smallest such n greater than ten.", "11", "x1"
            ),
            dapo_row("Unrelated problem about counting sheep in a field of grass.", "3", "x2"),
        ],
    )
    write_jsonl(
        evals / "amc23.jsonl",
        [
            {
                "id": 5,
                "question": "Let n be an integer with the stated property; find the smallest such n greater than ten.",
                "answer": 11.0,
            }
        ],
    )
    out = tmp_path / "math.jsonl"
    assert (
        main(
            ["prepare", "math", "--src", str(src), "--levels", "3-5", "--out", str(out), "--check-against", str(evals)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert (
        "overlap with math500, aime24, amc23 under" in printed
        and "2 training problems" in printed
        and "kept" in printed
    )
    assert len(out_rows(out)) == 2
    with pytest.raises(DataError, match="no usable rows .*2 dropped as found in the eval benchmarks"):
        main(
            [
                "prepare",
                "math",
                "--src",
                str(src),
                "--levels",
                "3-5",
                "--out",
                str(out),
                "--check-against",
                str(evals),
                "--drop-overlap",
            ]
        )
    assert (
        main(
            [
                "prepare",
                "dapo-math-17k",
                "--src",
                str(dapo),
                "--out",
                str(out),
                "--check-against",
                str(evals),
                "--drop-overlap",
            ]
        )
        == 0
    )
    assert [r["answer"] for r in out_rows(out)] == ["3"]
    assert "1 training problems {'amc23': 1} dropped" in capsys.readouterr().out


def test_bad_sources_are_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="--src .*nope: not found"):
        main(["prepare", "math", "--src", str(tmp_path / "nope"), "--out", str(tmp_path / "o.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no .jsonl, .json, .parquet files"):
        main(["prepare", "gsm8k", "--src", str(tmp_path / "empty"), "--out", str(tmp_path / "o.jsonl")])
    write_jsonl(tmp_path / "only_test" / "test.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(DataError, match=r"no 'train' files \(found the splits \['test'\]\)"):
        main(["prepare", "gsm8k", "--src", str(tmp_path / "only_test"), "--out", str(tmp_path / "o.jsonl")])
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        main(["prepare", "gsm8k", "--src", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o.jsonl")])
    with pytest.raises(DataError, match="--check-against .*: no benchmark file there"):
        main(
            [
                "prepare",
                "gsm8k",
                "--src",
                str(tmp_path / "only_test" / "test.jsonl"),
                "--out",
                str(tmp_path / "o.jsonl"),
                "--check-against",
                str(tmp_path / "empty"),
            ]
        )


def test_countdown_split_is_what_the_eval_reads_and_the_demo_evaluates(tmp_path, capsys):
    from megatron_rlvr.demo.command import write_eval_split
    from megatron_rlvr.problems.benchmarks import BenchmarkMissing, load_benchmark
    from megatron_rlvr.tasks.countdown import split_of

    data = tmp_path / "data"
    with pytest.raises(
        BenchmarkMissing, match=rf"make it with `megatron-rlvr data prepare countdown --out {data}/countdown.jsonl`$"
    ):
        load_benchmark("countdown", data)
    assert main(["prepare", "countdown", "--out", str(data / "countdown.jsonl"), "--count", "16"]) == 0
    assert "wrote 16 eval problems (seed 1234)" in capsys.readouterr().out
    problems = load_benchmark("countdown", data)
    assert len({p.problem_id for p in problems}) == 16
    assert all(split_of(tuple(p.reference["numbers"]), p.reference["target"]) == "eval" for p in problems)
    write_eval_split(tmp_path / "demo_eval", 16, seed=1234)  # the demo's own eval file, byte for byte
    assert (tmp_path / "demo_eval" / "countdown.jsonl").read_bytes() == (data / "countdown.jsonl").read_bytes()
    train = tmp_path / "train.jsonl"
    assert main(["prepare", "countdown", "--out", str(train), "--split", "train", "--count", "16"]) == 0
    assert not {r["id"] for r in out_rows(train)} & {p.problem_id for p in problems}
    with pytest.raises(DataError, match="--count 0: expected at least 1 problem"):
        main(["prepare", "countdown", "--out", str(train), "--count", "0"])
