"""One model's eval results file, ``<run dir>/results.json``: every problem's (n, c), the sampling settings, and the
pass@k table with its intervals, so anyone can recompute every figure without the (large) samples.

    {"format": "megatron-rlvr eval results", "version": 1, "model": ..., "settings": run.json's settings,
     "intervals": {"method", "resamples", "level", "seed"},
     "benchmarks": {NAME: {"problems": [id, ...], "n": [...], "c": [...], "digest": sha256 of (id, prompt, reference),
                           "pass_at_k": {"1": {"estimate", "low", "high"}, ...}}}}

`load_run` reads either that file (or the directory holding it) or, for a run that has none (written before results
files existed, or killed before its table), the run directory's ``run.json`` and ``samples/`` directly. c counts
samples with reward >= 1 (what `runner.problem_counts` counts); n is each problem's stored samples.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rlvr.errors import UserError
from megatron_rlvr.eval.bootstrap import IntervalSpec, bootstrap_pass_at_k
from megatron_rlvr.problems.benchmarks import Problem

RESULTS_FILE = "results.json"
FORMAT = "megatron-rlvr eval results"
VERSION = 1


class ResultsError(UserError, ValueError):
    """A path given as an eval run is neither a run directory nor a results file, or holds an unfinished run."""


@dataclass
class BenchmarkCounts:
    """Per problem of one benchmark, in a fixed order: its id, samples drawn (n) and samples correct (c)."""

    problem_ids: list[str]
    n: np.ndarray
    c: np.ndarray
    digest: str | None = None  # of the problems' texts and references; None when read from bare samples

    def samples_per_problem(self, where: str) -> int:
        low, high = int(self.n.min()), int(self.n.max())
        if low != high:
            raise ResultsError(
                f"{where}: its problems hold {low} to {high} samples each; an unfinished run? rerun "
                "its eval command to complete it"
            )
        return low


@dataclass
class RunCounts:
    source: Path
    model: str
    settings: dict[str, Any]
    benchmarks: dict[str, BenchmarkCounts]


def problems_digest(problems: Sequence[Problem]) -> str:
    """What makes two benchmark copies the same problems: ids, prompt texts and references, in order."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.problem_id, p.prompt, p.reference], sort_keys=True, default=str).encode())
    return h.hexdigest()


def counts_from_records(
    records: Mapping[tuple[str, str, int], Mapping[str, Any]], n_samples: int | None = None
) -> dict[str, BenchmarkCounts]:
    """(n, c) per problem from stored sample records (samples below ``n_samples`` only, when given), problems in the
    order their first sample was stored (the runner's block order)."""
    n_by: dict[tuple[str, str], int] = defaultdict(int)
    c_by: dict[tuple[str, str], int] = defaultdict(int)
    order: dict[str, list[str]] = defaultdict(list)
    for (bench, pid, sample), record in records.items():
        if n_samples is not None and sample >= n_samples:
            continue
        if (bench, pid) not in n_by:
            order[bench].append(pid)
        n_by[(bench, pid)] += 1
        c_by[(bench, pid)] += 1 if float(record["reward"]) >= 1.0 else 0
    return {
        bench: BenchmarkCounts(
            ids,
            np.array([n_by[(bench, p)] for p in ids], dtype=np.int64),
            np.array([c_by[(bench, p)] for p in ids], dtype=np.int64),
        )
        for bench, ids in order.items()
    }


def results_json(
    model: str,
    settings: Mapping[str, Any],
    counts: Mapping[str, BenchmarkCounts],
    ks: Sequence[int],
    spec: IntervalSpec,
) -> dict[str, Any]:
    benchmarks = {}
    for bench, bc in counts.items():
        intervals = bootstrap_pass_at_k(bc.n, bc.c, ks, spec, stream=bench)
        benchmarks[bench] = {
            "problems": list(bc.problem_ids),
            "n": bc.n.tolist(),
            "c": bc.c.tolist(),
            "digest": bc.digest,
            "pass_at_k": {str(k): iv.to_json() for k, iv in intervals.items()},
        }
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "settings": dict(settings),
        "intervals": spec.to_json(),
        "benchmarks": benchmarks,
    }


def write_results(run_dir: str | Path, payload: Mapping[str, Any]) -> Path:
    path = Path(run_dir) / RESULTS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _from_results_file(path: Path) -> RunCounts:
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise KeyError(f"format is {data.get('format')!r}, not {FORMAT!r}")
        benchmarks = {
            bench: BenchmarkCounts(
                [str(p) for p in b["problems"]],
                np.asarray(b["n"], dtype=np.int64),
                np.asarray(b["c"], dtype=np.int64),
                b.get("digest"),
            )
            for bench, b in data["benchmarks"].items()
        }
        for bench, bc in benchmarks.items():
            if not (len(bc.problem_ids) == bc.n.size == bc.c.size) or np.any(bc.c < 0) or np.any(bc.c > bc.n):
                raise ValueError(f"benchmark {bench}: problems, n and c must have equal lengths with 0 <= c <= n")
        return RunCounts(path, str(data.get("model", "")), dict(data["settings"]), benchmarks)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ResultsError(f"{path}: not an eval results file ({exc})") from None


def _from_run_dir(run_dir: Path) -> RunCounts:
    from megatron_rlvr.eval.store import load_records

    settings = json.loads((run_dir / "run.json").read_text())
    counts = counts_from_records(load_records(run_dir))
    if not counts:
        raise ResultsError(f"{run_dir}: holds no samples yet")
    return RunCounts(run_dir, str(settings.get("model", "")), settings, counts)


def load_run(path: str | os.PathLike) -> RunCounts:
    """An eval run from its results file, the directory holding one, or a bare run directory (run.json + samples/)."""
    path = Path(path)
    if path.is_file():
        return _from_results_file(path)
    if (path / RESULTS_FILE).is_file():
        return _from_results_file(path / RESULTS_FILE)
    if (path / "run.json").is_file() and (path / "samples").is_dir():
        return _from_run_dir(path)
    raise ResultsError(
        f"{path}: neither an eval run directory (run.json and samples/, e.g. <eval --out>/<model tag>) "
        f"nor its {RESULTS_FILE}"
    )
