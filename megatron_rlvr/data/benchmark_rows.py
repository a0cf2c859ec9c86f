"""Benchmark problems as dataset rows, so in-training validation on `eval.benchmarks` takes the dataset's own path
to prompt items (`items_from_rows`: the chat template, the length limit) under the data config's field names.

Contract: one row per problem, in order. Its fields are the problem's prompt (with the benchmark's instruction),
its reference answer and reward task under ``cfg``'s problem, answer and task keys, and the id
``"<benchmark>/<problem id>"`` under ``cfg.id_key``. A row is named ``"<benchmark>:<n>"``, n counting from 1 within
its benchmark, so an error names the benchmark and the problem's place in it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

from megatron_rlvr.data.config import DataConfig
from megatron_rlvr.data.sources import Row
from megatron_rlvr.problems.benchmarks import Problem


def problem_rows(problems: Iterable[Problem], cfg: DataConfig) -> Iterator[Row]:
    counts: Counter[str] = Counter()
    for p in problems:
        counts[p.benchmark] += 1
        n = counts[p.benchmark]
        data = {
            cfg.problem_key: p.prompt,
            cfg.answer_key: p.reference,
            cfg.task_key: p.task,
            cfg.id_key: f"{p.benchmark}/{p.problem_id}",
        }
        yield Row(f"{p.benchmark}:{n}", p.benchmark, n, data)
