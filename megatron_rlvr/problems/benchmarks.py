"""Benchmark loaders: local JSONL/Parquet files -> `Problem`s (id, prompt text, reward task, reference).

Nothing is downloaded. Each benchmark is looked up under ``data_dir`` by the file names in its `BenchmarkSpec`
(``<name>.jsonl`` or ``<name>.parquet``); field names follow each benchmark's public release, with the alternates
listed. A missing file or field is an error naming the file (and row) and the expected layout. `layouts_markdown`
renders the table docs/evaluation.md documents ("Benchmark files").
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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


class BenchmarkMissing(UserError, FileNotFoundError):
    """No file of a benchmark under --data-dir; the message lists the names tried and the layout."""


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


# --- per-benchmark row -> Problem ------------------------------------------------------------------------------


def _math_row(row: Row, i: int, bench: str) -> Problem:
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


def _gsm8k_row(row: Row, i: int, bench: str) -> Problem:
    question, answer = row.get("question"), str(row.get("answer"))
    if "####" not in answer:
        raise BenchmarkError(f"{row.where}: gsm8k 'answer' must end with '#### <number>'; got {answer[-80:]!r}")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return Problem(bench, _row_id(row, i, "id"), f"{question}{MATH_SUFFIX}", "math", final, str(question))


def _bbh_row(row: Row, i: int, bench: str) -> Problem:
    task = row.get("task", "subset", required=False) or row.data.get("_file_task") or "bbh"
    pid = f"{task}/{_row_id(row, i, 'id', 'idx')}"
    return Problem(
        bench, pid, f"{row.get('input')}{LOGIC_SUFFIX}", "logic", str(row.get("target")), str(row.get("input"))
    )


def _synlogic_row(row: Row, i: int, bench: str) -> Problem:
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


def _livecodebench_row(row: Row, i: int, bench: str) -> Problem:
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


def _humanevalplus_row(row: Row, i: int, bench: str) -> Problem:
    prompt_code = row.get("prompt")
    entry = row.get("entry_point")
    imports = "\n".join(line for line in str(prompt_code).splitlines() if re.match(r"(import|from)\s", line))
    prompt = f"Complete the following Python function.\n\n```python\n{prompt_code}```{CODE_SUFFIX}"
    reference = {"tests": str(row.get("test")), "entry_point": entry, "prelude": imports}
    return Problem(bench, _row_id(row, i, "task_id"), prompt, "code", reference, str(prompt_code))


def _countdown_row(row: Row, i: int, bench: str) -> Problem:
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


def _reasoning_gym_row(row: Row, i: int, bench: str) -> Problem:
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


@dataclass(frozen=True)
class BenchmarkSpec:
    files: tuple[str, ...]  # stems tried under data_dir, each as .jsonl then .parquet
    layout: str
    build: Callable[[Row, int, str], Problem]
    per_task_dir: bool = False  # BBH: also a directory of <task>.jsonl files
    make: str = ""  # the command that writes the file, for benchmarks generated here ({data_dir}: the folder)


MATH_LAYOUT = "(also accepted: 'question' for 'problem', a 'solution' whose last \\boxed{} is the answer)"
BENCHMARKS: dict[str, BenchmarkSpec] = {
    "math500": BenchmarkSpec(
        ("math500", "MATH-500", "math500/test"),
        f"MATH-500 (HuggingFaceH4/MATH-500): 'unique_id', 'problem', 'answer' {MATH_LAYOUT}",
        _math_row,
    ),
    "aime24": BenchmarkSpec(
        ("aime24", "aime_2024"),
        f"AIME 2024 (HuggingFaceH4/aime_2024): 'id', 'problem', 'answer' {MATH_LAYOUT}",
        _math_row,
    ),
    "aime25": BenchmarkSpec(
        ("aime25", "aime_2025"), f"AIME 2025 (yentinglin/aime_2025): 'id', 'problem', 'answer' {MATH_LAYOUT}", _math_row
    ),
    "amc23": BenchmarkSpec(
        ("amc23",), f"AMC 2023 (math-ai/amc23): 'id', 'question', 'answer' (number) {MATH_LAYOUT}", _math_row
    ),
    "minerva": BenchmarkSpec(
        ("minerva_math", "minerva"),
        f"Minerva Math (Qwen2.5-Math minerva_math): 'idx', 'problem', 'solution' (or 'answer') {MATH_LAYOUT}",
        _math_row,
    ),
    "olympiadbench": BenchmarkSpec(
        ("olympiadbench", "OlympiadBench"),
        "OlympiadBench (OE_TO_maths_en_COMP): 'id', 'question', 'final_answer' (list of strings)",
        _math_row,
    ),
    "gsm8k": BenchmarkSpec(
        ("gsm8k", "gsm8k/test"), "GSM8K (openai/gsm8k main): 'question', 'answer' ending in '#### <number>'", _gsm8k_row
    ),
    "synlogic": BenchmarkSpec(
        ("synlogic", "SynLogic"),
        "SynLogic: 'prompt' (str or chat messages), 'answer' or 'reward_model.ground_truth', optional 'data_source', 'id'",
        _synlogic_row,
    ),
    "bbh": BenchmarkSpec(
        ("bbh",),
        "BIG-Bench Hard (lukaemon/bbh): 'input', 'target', plus 'task' in one file, or a directory bbh/<task>.jsonl",
        _bbh_row,
        per_task_dir=True,
    ),
    "livecodebench": BenchmarkSpec(
        ("livecodebench", "code_generation_lite"),
        "LiveCodeBench (code_generation_lite): 'question_id', 'question_content', 'starter_code', 'public_test_cases' and 'private_test_cases' (JSON strings, private possibly base64/zlib/pickled), 'metadata' with 'func_name' for functional tests",
        _livecodebench_row,
    ),
    "humanevalplus": BenchmarkSpec(
        ("humanevalplus", "HumanEvalPlus"),
        "HumanEval+ (evalplus/humanevalplus): 'task_id', 'prompt', 'entry_point', 'test' (defines check(candidate))",
        _humanevalplus_row,
    ),
    "countdown": BenchmarkSpec(
        ("countdown",),
        "countdown (the demo task): 'id', 'numbers' (list of ints), 'target' (int), optional 'prompt'",
        _countdown_row,
        make="megatron-rlvr data prepare countdown --out {data_dir}/countdown.jsonl",
    ),
    "reasoning_gym": BenchmarkSpec(
        ("reasoning_gym",),
        "reasoning-gym rows as `data prepare reasoning-gym` writes them: 'id', 'problem', 'answer' (the entry less "
        "its question), 'task' (reasoning_gym:NAME)",
        _reasoning_gym_row,
        make="megatron-rlvr data prepare reasoning-gym --tasks NAME --size N --seed S --out {data_dir}/reasoning_gym.jsonl",
    ),
}


def _read_records(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BenchmarkError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise BenchmarkError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    return records


def benchmark_files(name: str, data_dir: str | Path) -> list[tuple[Path, str | None]]:
    """The files of benchmark ``name`` under ``data_dir`` as (path, per-file task); FileNotFoundError if none."""
    spec = BENCHMARKS.get(name)
    if spec is None:
        raise BenchmarkError(f"benchmark {name!r}: unknown; expected one of {sorted(BENCHMARKS)}")
    data_dir = Path(data_dir)
    tried = []
    for stem in spec.files:
        for suffix in (".jsonl", ".parquet"):
            path = data_dir / f"{stem}{suffix}"
            tried.append(str(path))
            if path.is_file():
                return [(path, None)]
    if spec.per_task_dir:
        folder = data_dir / spec.files[0]
        tried.append(f"{folder}/<task>.jsonl")
        if folder.is_dir():
            files = sorted(folder.glob("*.jsonl")) + sorted(folder.glob("*.parquet"))
            if files:
                return [(f, f.stem) for f in files]
    make = (
        f"; make it with `{spec.make.format(data_dir=data_dir)}`" if spec.make else f". Expected layout: {spec.layout}"
    )
    raise BenchmarkMissing(f"benchmark {name!r}: no data file; tried {', '.join(tried)}{make}")


def load_benchmark(name: str, data_dir: str | Path, limit: int | None = None) -> list[Problem]:
    """All problems of ``name`` (the first ``limit`` when given), ids unique within the benchmark."""
    spec = BENCHMARKS.get(name)
    if spec is None:
        raise BenchmarkError(f"benchmark {name!r}: unknown; expected one of {sorted(BENCHMARKS)}")
    problems: list[Problem] = []
    seen: dict[str, str] = {}
    for path, file_task in benchmark_files(name, data_dir):
        for i, record in enumerate(_read_records(path)):
            if file_task is not None:
                record = {**record, "_file_task": file_task}
            problem = spec.build(Row(record, f"{path}: row {i}", spec.layout), i, name)
            if problem.problem_id in seen:
                raise BenchmarkError(
                    f"{path}: row {i}: problem id {problem.problem_id!r} repeats ({seen[problem.problem_id]})"
                )
            seen[problem.problem_id] = f"{path}: row {i}"
            problems.append(problem)
            if limit is not None and len(problems) >= limit:
                return problems
    if not problems:
        raise BenchmarkError(
            f"benchmark {name!r}: {', '.join(str(p) for p, _ in benchmark_files(name, data_dir))} holds no rows"
        )
    return problems


def layouts_markdown() -> str:
    """The table of file names and field layouts (docs/evaluation.md, "Benchmark files")."""
    lines = ["| benchmark | file under --data-dir (.jsonl or .parquet) | fields |", "|---|---|---|"]
    for name, spec in BENCHMARKS.items():
        files = " or ".join(f"`{s}`" for s in spec.files) + (" or `bbh/<task>.jsonl`" if spec.per_task_dir else "")
        lines.append(f"| {name} | {files} | {spec.layout} |")
    return "\n".join(lines)
