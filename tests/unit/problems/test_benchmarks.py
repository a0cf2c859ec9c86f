"""Benchmark loaders on tiny files in each public layout; missing files and fields are clear errors."""

import base64
import json
import pickle
import zlib

import pytest

from megatron_rlvr.problems.benchmarks import BENCHMARKS, layouts_markdown, load_benchmark
from megatron_rlvr.rewards import score


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_math_family_layouts(tmp_path):
    write_jsonl(
        tmp_path / "math500.jsonl",
        [
            {
                "problem": "1+1?",
                "solution": "...",
                "answer": "2",
                "subject": "A",
                "level": 1,
                "unique_id": "test/a/1.json",
            }
        ],
    )
    write_jsonl(
        tmp_path / "aime24.jsonl",
        [{"id": 60, "problem": "p", "solution": "s", "answer": "204", "url": "u", "year": "2024"}],
    )
    write_jsonl(tmp_path / "amc23.jsonl", [{"id": 0, "question": "q", "answer": 27.0, "url": "u"}])
    write_jsonl(
        tmp_path / "minerva_math.jsonl",
        [{"problem": "p", "solution": "so \\boxed{3\\times 10^{8}}", "type": "t", "idx": 5}],
    )
    write_jsonl(
        tmp_path / "olympiadbench.jsonl",
        [{"id": 1606, "question": "q", "final_answer": ["$\\frac{1}{2}$"], "solution": ["s"]}],
    )
    write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "q", "answer": "work <<1+1=2>>\n#### 1,234"}])
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"id": "I-1", "problem": "p", "answer": "5"}]), tmp_path / "aime25.parquet")
    expect = {
        "math500": ("test/a/1.json", "2"),
        "aime24": ("60", "204"),
        "amc23": ("0", "27"),
        "minerva": ("5", "3\\times 10^{8}"),
        "olympiadbench": ("1606", "\\frac{1}{2}"),
        "gsm8k": ("0", "1234"),
        "aime25": ("I-1", "5"),
    }
    for name, (pid, answer) in expect.items():
        (problem,) = load_benchmark(name, tmp_path)
        assert (problem.problem_id, problem.reference, problem.task) == (pid, answer, "math"), name
        assert "\\boxed{}" in problem.prompt


def test_logic_layouts(tmp_path):
    write_jsonl(
        tmp_path / "bbh" / "boolean_expressions.jsonl", [{"input": "not ( True ) and ( True ) is", "target": "False"}]
    )
    write_jsonl(tmp_path / "bbh" / "date_understanding.jsonl", [{"input": "q", "target": "(A)"}])
    problems = load_benchmark("bbh", tmp_path)
    assert [p.problem_id for p in problems] == ["boolean_expressions/0", "date_understanding/0"]
    assert score("logic", "So the answer is (A).", problems[1].reference) == 1.0
    write_jsonl(
        tmp_path / "synlogic.jsonl",
        [
            {
                "data_source": "arrow_maze",
                "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "Solve it"}],
                "reward_model": {"ground_truth": "[1, 2]", "style": "rule"},
            },
            {"id": "x", "prompt": "plain", "answer": "yes"},
        ],
    )
    a, b = load_benchmark("synlogic", tmp_path)
    assert (a.problem_id, a.prompt, a.reference) == ("arrow_maze/0", "Solve it", "[1, 2]")
    assert (b.problem_id, b.reference, b.task) == ("x", "yes", "logic")


def test_humanevalplus_canonical_solution_passes(tmp_path):
    prompt = 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum."""\n'
    write_jsonl(
        tmp_path / "humanevalplus.jsonl",
        [
            {
                "task_id": "HumanEval/0",
                "prompt": prompt,
                "canonical_solution": "    return sum(xs)\n",
                "entry_point": "total",
                "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n",
            }
        ],
    )
    (problem,) = load_benchmark("humanevalplus", tmp_path)
    assert problem.problem_id == "HumanEval/0" and problem.task == "code"
    # a response without the import still passes: the prompt's imports run first (the "prelude")
    assert (
        score("code", "```python\ndef total(xs: List[int]) -> int:\n    return sum(xs)\n```", problem.reference) == 1.0
    )
    assert score("code", "```python\ndef total(xs):\n    return 0\n```", problem.reference) == 0.0


def test_livecodebench_stdin_functional_and_compressed_tests(tmp_path):
    private = [{"input": "5\n", "output": "10\n", "testtype": "stdin"}]
    packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    functional = [{"input": "[1, 2]\n3", "output": "[0, 1]", "testtype": "functional"}]
    write_jsonl(
        tmp_path / "livecodebench.jsonl",
        [
            {
                "question_id": "abc1",
                "question_content": "Double it.",
                "starter_code": "",
                "platform": "atcoder",
                "public_test_cases": json.dumps([{"input": "2\n", "output": "4\n", "testtype": "stdin"}]),
                "private_test_cases": packed,
                "metadata": "{}",
            },
            {
                "question_id": "lc1",
                "question_content": "Two sum.",
                "starter_code": "class Solution:\n    def twoSum(self, nums, target):",
                "public_test_cases": json.dumps(functional),
                "private_test_cases": "",
                "metadata": json.dumps({"func_name": "twoSum"}),
            },
        ],
    )
    stdin_problem, functional_problem = load_benchmark("livecodebench", tmp_path)
    assert stdin_problem.reference == {"io": [{"input": "2\n", "output": "4\n"}, {"input": "5\n", "output": "10\n"}]}
    assert score("code", "print(2 * int(input()))", stdin_problem.reference) == 1.0
    assert score("code", "print(4)", stdin_problem.reference) == 0.0
    solution = "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n"
    assert score("code", solution, functional_problem.reference) == 1.0
    assert score("code", solution.replace("[0, 1]", "[1, 0]"), functional_problem.reference) == 0.0


def test_hostile_pickle_in_a_benchmark_file_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    packed = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    write_jsonl(
        tmp_path / "livecodebench.jsonl",
        [{"question_id": "q", "question_content": "c", "public_test_cases": "[]", "private_test_cases": packed}],
    )
    with pytest.raises(ValueError, match="livecodebench.jsonl: row 0: test cases are neither JSON nor"):
        load_benchmark("livecodebench", tmp_path)


def test_missing_file_field_and_bad_json_are_clear_errors(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"benchmark 'aime24': no data file; tried .*aime24.jsonl.*Expected layout: AIME 2024"
    ):
        load_benchmark("aime24", tmp_path)
    write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match=r"gsm8k.jsonl: row 0: missing field 'answer'; expected layout: GSM8K"):
        load_benchmark("gsm8k", tmp_path)
    (tmp_path / "math500.jsonl").write_text('{"problem": "p", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"math500.jsonl:2: not valid JSON"):
        load_benchmark("math500", tmp_path)
    write_jsonl(
        tmp_path / "countdown.jsonl",
        [{"id": "a", "numbers": [1], "target": 1}, {"id": "a", "numbers": [2], "target": 2}],
    )
    with pytest.raises(ValueError, match="problem id 'a' repeats"):
        load_benchmark("countdown", tmp_path)
    with pytest.raises(ValueError, match="unknown"):
        load_benchmark("mmlu", tmp_path)


def test_reasoning_gym_rows_as_data_prepare_writes_them(tmp_path):
    from megatron_rlvr.data.prepare import main as data_main

    args = ["prepare", "reasoning-gym", "--tasks", "leg_counting", "--size", "4", "--seed", "2", "--no-instruction"]
    assert data_main([*args, "--out", str(tmp_path / "reasoning_gym.jsonl")]) == 0
    problems = load_benchmark("reasoning_gym", tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "reasoning_gym.jsonl").read_text().splitlines()]
    assert [p.problem_id for p in problems] == [r["id"] for r in rows]
    assert [(p.prompt, p.task, p.reference) for p in problems] == [(r["problem"], r["task"], r["answer"]) for r in rows]
    from megatron_rlvr.rewards.reasoning_gym import score as gym_score

    gold = rows[0]["answer"]["answer"]
    assert gym_score(problems[0].task, f"<answer>{gold}</answer>", problems[0].reference) == 1.0
    write_jsonl(tmp_path / "reasoning_gym.jsonl", [{**rows[0], "task": "math"}])
    with pytest.raises(ValueError, match=r"row 0: 'task' must be reasoning_gym:NAME, got 'math'"):
        load_benchmark("reasoning_gym", tmp_path)
    write_jsonl(tmp_path / "reasoning_gym.jsonl", [{**rows[0], "answer": "4"}])
    with pytest.raises(ValueError, match=r"row 0: 'answer' must be the dataset entry"):
        load_benchmark("reasoning_gym", tmp_path)


def test_layouts_table_lists_every_benchmark():
    table = layouts_markdown()
    for name in BENCHMARKS:
        assert f"| {name} |" in table
