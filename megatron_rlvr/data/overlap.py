"""Training problems that also appear in an evaluation benchmark (MATH-500 is drawn from MATH's test split, but
releases get remixed): a training problem overlaps when its normalized text equals a benchmark problem's, or
contains it whole (a release that wraps problems in instructions).

The benchmarks are the eval's own files under a data directory, read by the eval's loaders
(`megatron_rlvr.problems.benchmarks`: every benchmark whose file is there). Containment is found through an index
of each benchmark problem's first 8 words, so a check costs one pass over the training text.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from megatron_rlvr.data.releases import normalize
from megatron_rlvr.data.sources import DataError

WINDOW = 8  # words in the index key; shorter benchmark problems must match exactly


class BenchmarkIndex:
    def __init__(self, texts: list[tuple[str, str]]):
        """``texts``: (name such as "math500/test/algebra/1.json", problem text)."""
        self.exact: dict[str, str] = {}
        self.by_head: dict[tuple[str, ...], list[tuple[str, str]]] = defaultdict(list)
        for name, text in texts:
            norm = normalize(text)
            if not norm:
                continue
            self.exact.setdefault(norm, name)
            words = tuple(norm.split())
            if len(words) >= WINDOW:
                self.by_head[words[:WINDOW]].append((norm, name))
        self.size = len(self.exact)

    def find(self, text: str) -> str | None:
        """The benchmark problem ``text`` equals or contains, or None."""
        norm = normalize(text)
        if norm in self.exact:
            return self.exact[norm]
        words = norm.split()
        padded = f" {norm} "
        for start in range(len(words) - WINDOW + 1):
            for candidate, name in self.by_head.get(tuple(words[start : start + WINDOW]), ()):
                if f" {candidate} " in padded:
                    return name
        return None


def load_benchmark_index(data_dir: str | Path) -> tuple[BenchmarkIndex, list[str]]:
    """The index of every benchmark with a file under ``data_dir``, and those benchmarks' names."""
    from megatron_rlvr.problems.benchmarks import BENCHMARKS, benchmark_files, load_benchmark

    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"--check-against {data_dir}: not a directory (expected the eval's --data-dir)")
    texts, found = [], []
    for name in BENCHMARKS:
        try:
            benchmark_files(name, data_dir)
        except FileNotFoundError:
            continue
        found.append(name)
        texts += [(f"{name}/{p.problem_id}", p.text) for p in load_benchmark(name, data_dir)]
    if not found:
        raise DataError(
            f"--check-against {data_dir}: no benchmark file there (expected e.g. math500.jsonl, "
            f"aime24.jsonl, gsm8k.jsonl: the eval's --data-dir layout)"
        )
    return BenchmarkIndex(texts), found
