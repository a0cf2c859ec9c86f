"""Benchmark loaders: local JSONL/Parquet files -> `Problem`s (id, prompt text, reward task, reference).

Nothing is downloaded. Each benchmark is looked up under ``data_dir`` by the file names in its `BenchmarkSpec`
(``<name>.jsonl`` or ``<name>.parquet``); each row becomes a `Problem` through the builder of its release format
(problems/benchmark_formats.py), whose field names follow the benchmark's public release, with the alternates
listed. A missing file or field is an error naming the file (and row) and the expected layout. `layouts_markdown`
renders the table docs/evaluation.md documents ("Benchmark files").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_rlvr.errors import UserError
from megatron_rlvr.problems.benchmark_formats import (
    BenchmarkError,
    Problem,
    Row,
    bbh_row,
    countdown_row,
    gsm8k_row,
    humanevalplus_row,
    livecodebench_row,
    math_row,
    reasoning_gym_row,
    synlogic_row,
)


class BenchmarkMissing(UserError, FileNotFoundError):
    """No file of a benchmark under --data-dir; the message lists the names tried and the layout."""


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
        math_row,
    ),
    "aime24": BenchmarkSpec(
        ("aime24", "aime_2024"),
        f"AIME 2024 (HuggingFaceH4/aime_2024): 'id', 'problem', 'answer' {MATH_LAYOUT}",
        math_row,
    ),
    "aime25": BenchmarkSpec(
        ("aime25", "aime_2025"), f"AIME 2025 (yentinglin/aime_2025): 'id', 'problem', 'answer' {MATH_LAYOUT}", math_row
    ),
    "amc23": BenchmarkSpec(
        ("amc23",), f"AMC 2023 (math-ai/amc23): 'id', 'question', 'answer' (number) {MATH_LAYOUT}", math_row
    ),
    "minerva": BenchmarkSpec(
        ("minerva_math", "minerva"),
        f"Minerva Math (Qwen2.5-Math minerva_math): 'idx', 'problem', 'solution' (or 'answer') {MATH_LAYOUT}",
        math_row,
    ),
    "olympiadbench": BenchmarkSpec(
        ("olympiadbench", "OlympiadBench"),
        "OlympiadBench (OE_TO_maths_en_COMP): 'id', 'question', 'final_answer' (list of strings)",
        math_row,
    ),
    "gsm8k": BenchmarkSpec(
        ("gsm8k", "gsm8k/test"), "GSM8K (openai/gsm8k main): 'question', 'answer' ending in '#### <number>'", gsm8k_row
    ),
    "synlogic": BenchmarkSpec(
        ("synlogic", "SynLogic"),
        "SynLogic: 'prompt' (str or chat messages), 'answer' or 'reward_model.ground_truth', optional 'data_source', 'id'",
        synlogic_row,
    ),
    "bbh": BenchmarkSpec(
        ("bbh",),
        "BIG-Bench Hard (lukaemon/bbh): 'input', 'target', plus 'task' in one file, or a directory bbh/<task>.jsonl",
        bbh_row,
        per_task_dir=True,
    ),
    "livecodebench": BenchmarkSpec(
        ("livecodebench", "code_generation_lite"),
        "LiveCodeBench (code_generation_lite): 'question_id', 'question_content', 'starter_code', 'public_test_cases' and 'private_test_cases' (JSON strings, private possibly base64/zlib/pickled), 'metadata' with 'func_name' for functional tests",
        livecodebench_row,
    ),
    "humanevalplus": BenchmarkSpec(
        ("humanevalplus", "HumanEvalPlus"),
        "HumanEval+ (evalplus/humanevalplus): 'task_id', 'prompt', 'entry_point', 'test' (defines check(candidate))",
        humanevalplus_row,
    ),
    "countdown": BenchmarkSpec(
        ("countdown",),
        "countdown (the demo task): 'id', 'numbers' (list of ints), 'target' (int), optional 'prompt'",
        countdown_row,
        make="megatron-rlvr data prepare countdown --out {data_dir}/countdown.jsonl",
    ),
    "reasoning_gym": BenchmarkSpec(
        ("reasoning_gym",),
        "reasoning-gym rows as `data prepare reasoning-gym` writes them: 'id', 'problem', 'answer' (the entry less "
        "its question), 'task' (reasoning_gym:NAME)",
        reasoning_gym_row,
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
