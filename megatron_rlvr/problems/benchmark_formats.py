"""How one row of a benchmark's public release becomes a `Problem` (id, prompt text, reward task, reference).

One builder per release format (``math_row``: MATH-500, AIME, AMC, Minerva, OlympiadBench; ``gsm8k_row``,
``bbh_row``, ``synlogic_row``, ``livecodebench_row``, ``humanevalplus_row``, ``countdown_row``,
``reasoning_gym_row``), each ``(row, index, benchmark) -> Problem``: it reads the release's field names (with the
alternates other releases use), appends the task's instruction to the problem's text (the same suffixes data
prepare's releases append to training problems), and raises `BenchmarkError` naming the file, the row and the
expected layout for a missing or malformed field. Which benchmark uses which builder, and where its files are, is
problems/benchmarks.py's table.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import re
import zlib
from dataclasses import dataclass
from typing import Any

from megatron_rlvr.errors import UserError

# The instructions appended to a problem's text. Data prepare's math and code releases (data/releases/) append the
# same ones to training problems, so training and evaluation prompts agree.
MATH_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
LOGIC_SUFFIX = '\n\nThink step by step, then finish with "So the answer is <answer>."'
CODE_SUFFIX = "\n\nReturn the complete program in one ```python code block."
# a code prompt: the problem, one of these two, then CODE_SUFFIX
STDIN_INSTRUCTION = "\n\nRead the input from standard input and write the answer to standard output."
STARTER_INSTRUCTION = "\n\nComplete this starter code:\n```python\n{starter}\n```"


class BenchmarkError(UserError, ValueError):
    """A benchmark file or row does not have the expected layout; the message names the file, the row and it."""


@dataclass(frozen=True)
class Problem:
    benchmark: str
    problem_id: str
    prompt: str  # the text given to the model (before any chat template)
    task: str  # reward task: math | code | logic | countdown
    reference: Any
    text: str = ""  # the problem as released, before any instruction added here (for overlap checks)


class Row:
    """One record of a benchmark file, with errors that name the file, the row and the expected layout."""

    def __init__(self, data: dict, where: str, layout: str):
        self.data, self.where, self.layout = data, where, layout

    def get(self, *names: str, required: bool = True) -> Any:
        for name in names:
            if name in self.data and self.data[name] is not None:
                return self.data[name]
        if required:
            raise BenchmarkError(
                f"{self.where}: missing field {' or '.join(repr(n) for n in names)}; expected layout: {self.layout}"
            )
        return None


def _row_id(row: Row, index: int, *names: str) -> str:
    value = row.get(*names, required=False)
    return str(index) if value is None else str(value)


def _last_boxed(text: str) -> str | None:
    from megatron_rlvr.rewards.answers import last_boxed

    found = last_boxed(text)
    return found or None


# ---------------------------------------------------------------------------------------------------------------
# One builder per release format: (row, index in the file, benchmark name) -> Problem


def math_row(row: Row, i: int, bench: str) -> Problem:
    question = row.get("problem", "question", "Problem", "Question")
    answer = row.get("answer", "Answer", "final_answer", required=False)
    if answer is None:  # Minerva / MATH releases that keep only a worked solution: its last \boxed is the answer
        solution = row.get("solution", "Solution")
        answer = _last_boxed(str(solution))
        if answer is None:
            raise BenchmarkError(
                f"{row.where}: no 'answer' field and no \\boxed{{}} in 'solution'; expected layout: {row.layout}"
            )
    if isinstance(answer, list):  # OlympiadBench: final_answer is a list of strings
        answer = ", ".join(str(a).strip("$ ") for a in answer)
    if isinstance(answer, float) and answer.is_integer():  # AMC23 stores 27.0
        answer = int(answer)
    return Problem(
        bench,
        _row_id(row, i, "unique_id", "id", "ID", "idx", "problem_id"),
        f"{question}{MATH_SUFFIX}",
        "math",
        str(answer).strip(),
        str(question),
    )


def gsm8k_row(row: Row, i: int, bench: str) -> Problem:
    question, answer = row.get("question"), str(row.get("answer"))
    if "####" not in answer:
        raise BenchmarkError(f"{row.where}: gsm8k 'answer' must end with '#### <number>'; got {answer[-80:]!r}")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return Problem(bench, _row_id(row, i, "id"), f"{question}{MATH_SUFFIX}", "math", final, str(question))


def bbh_row(row: Row, i: int, bench: str) -> Problem:
    task = row.get("task", "subset", required=False) or row.data.get("_file_task") or "bbh"
    pid = f"{task}/{_row_id(row, i, 'id', 'idx')}"
    return Problem(
        bench, pid, f"{row.get('input')}{LOGIC_SUFFIX}", "logic", str(row.get("target")), str(row.get("input"))
    )


def synlogic_row(row: Row, i: int, bench: str) -> Problem:
    prompt = row.get("prompt", "question")
    if isinstance(prompt, list):  # verl-style chat messages: the last user turn is the question
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise BenchmarkError(f"{row.where}: 'prompt' holds no user message; expected layout: {row.layout}")
        prompt = users[-1]
    answer = row.get("answer", required=False)
    if answer is None:
        reward_model = row.get("reward_model")
        answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        if answer is None:
            raise BenchmarkError(
                f"{row.where}: no 'answer' and no 'reward_model.ground_truth'; expected layout: {row.layout}"
            )
    task = row.get("data_source", "task", required=False)
    pid = _row_id(row, i, "id", "idx")
    return Problem(bench, f"{task}/{pid}" if task else pid, str(prompt), "logic", str(answer), str(prompt))


def _decode_lcb_tests(value: Any, where: str) -> list[dict]:
    """LiveCodeBench test lists: a JSON string, or (private tests) base64(zlib(pickle(JSON string)))."""
    if isinstance(value, list):
        return value
    text = str(value)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        raw = zlib.decompress(base64.b64decode(text))
        return json.loads(_StringOnlyUnpickler(io.BytesIO(raw)).load())
    except Exception as exc:  # noqa: BLE001
        raise BenchmarkError(f"{where}: test cases are neither JSON nor base64/zlib/pickled JSON ({exc})") from None


class _StringOnlyUnpickler(pickle.Unpickler):
    """The compressed LCB tests pickle one str; refuse any class so a hostile file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a benchmark file")


def functional_tests_as_asserts(cases: list[dict], func_name: str) -> str:
    """LeetCode-style functional test cases (``input``: one JSON argument per line, ``output``: the JSON result) as
    a Python test script of asserts against ``Solution().<func_name>``: the code verifier's ``{"tests": ...}``
    reference. LiveCodeBench's and DeepCoder's functional cases share this layout. A malformed case raises
    (json.JSONDecodeError for a line that is not JSON, KeyError for a missing field)."""
    lines = ["import json", "_solution = Solution()"]
    for case in cases:
        args = [json.loads(line) for line in case["input"].split("\n") if line.strip()]
        expected = json.loads(case["output"])
        lines.append(f"assert _solution.{func_name}(*{args!r}) == {expected!r}")
    return "\n".join(lines) + "\n"


def livecodebench_row(row: Row, i: int, bench: str) -> Problem:
    content = row.get("question_content")
    cases = _decode_lcb_tests(row.get("public_test_cases"), row.where)
    private = row.get("private_test_cases", required=False)
    if private:
        cases = cases + _decode_lcb_tests(private, row.where)
    if not cases:
        raise BenchmarkError(f"{row.where}: no test cases; expected layout: {row.layout}")
    starter = row.get("starter_code", required=False) or ""
    functional = any(c.get("testtype") == "functional" for c in cases)
    if functional:
        metadata = row.get("metadata", required=False) or {}
        metadata = json.loads(metadata) if isinstance(metadata, str) else metadata
        func_name = metadata.get("func_name")
        if not func_name:
            raise BenchmarkError(
                f"{row.where}: functional tests need metadata.func_name; expected layout: {row.layout}"
            )
        reference: dict = {"tests": functional_tests_as_asserts(cases, func_name)}
        prompt = f"{content}{STARTER_INSTRUCTION.format(starter=starter)}{CODE_SUFFIX}"
    else:
        reference = {"io": [{"input": c["input"], "output": c["output"]} for c in cases]}
        prompt = f"{content}{STDIN_INSTRUCTION}{CODE_SUFFIX}"
    return Problem(bench, _row_id(row, i, "question_id", "id"), prompt, "code", reference, str(content))


def humanevalplus_row(row: Row, i: int, bench: str) -> Problem:
    prompt_code = row.get("prompt")
    entry = row.get("entry_point")
    imports = "\n".join(line for line in str(prompt_code).splitlines() if re.match(r"(import|from)\s", line))
    prompt = f"Complete the following Python function.\n\n```python\n{prompt_code}```{CODE_SUFFIX}"
    reference = {"tests": str(row.get("test")), "entry_point": entry, "prelude": imports}
    return Problem(bench, _row_id(row, i, "task_id"), prompt, "code", reference, str(prompt_code))


def countdown_row(row: Row, i: int, bench: str) -> Problem:
    from megatron_rlvr.tasks.countdown import format_prompt

    numbers, target = row.get("numbers"), row.get("target")
    if not isinstance(numbers, list) or not all(isinstance(x, int) for x in numbers) or not isinstance(target, int):
        raise BenchmarkError(
            f"{row.where}: 'numbers' must be a list of ints and 'target' an int; expected layout: {row.layout}"
        )
    prompt = row.get("prompt", required=False) or format_prompt(numbers, target)
    return Problem(
        bench, _row_id(row, i, "id"), str(prompt), "countdown", {"numbers": numbers, "target": target}, str(prompt)
    )


def reasoning_gym_row(row: Row, i: int, bench: str) -> Problem:
    from megatron_rlvr.rewards.reasoning_gym import TASK_PREFIX, dataset_name

    task, problem, reference = row.get("task"), row.get("problem"), row.get("answer")
    if not isinstance(task, str) or dataset_name(task) is None:
        raise BenchmarkError(
            f"{row.where}: 'task' must be {TASK_PREFIX}NAME, got {task!r:.60}; expected layout: {row.layout}"
        )
    if not isinstance(reference, dict) or not isinstance(reference.get("metadata"), dict):
        raise BenchmarkError(
            f"{row.where}: 'answer' must be the dataset entry {{'answer', 'metadata': {{...}}}}; expected layout: "
            f"{row.layout}"
        )
    return Problem(bench, _row_id(row, i, "id"), str(problem), task, reference, str(problem))
