"""What an eval job will cost before it samples: samples, tokens, wall time, GPU-hours, and how wide its intervals
can be.

Figures come from one of (best first):
- a calibration: `megatron-rlvr eval --estimate ...` draws each model's first request (stored, so the real run does
  not redraw it), times it with the engine's start, and extrapolates per sample;
- recorded figures: the ``timing.jsonl`` of a run directory of the same model and sampling settings (every eval
  session appends one line: samples, tokens, seconds, engine start), e.g. a K = 64 run for a K = 1024 job;
- a throughput the user gives (``--tokens-per-second``), with every sample at max_new_tokens unless a recorded
  tokens-per-sample figure exists: an upper bound.
Without any, the estimate says so and gives what needs none: samples, the token bound, the interval width bound.

Wall time = engine start + samples to draw x seconds per sample, per model, models in sequence (as `evaluate` runs
them). GPU-hours = wall time x the job's GPUs (rollout.tp for a recipe, WORLD_SIZE under torchrun); none on CPU.
The interval bound: a 95% interval over P problems is about +-1.96 sd / sqrt(P) and a per-problem pass@k lies in
[0, 1], so sd <= 0.5: +-1.96 * 0.5 / sqrt(P) at most (a paired difference: up to twice that).

    megatron-rlvr estimate configs/eval_k1024_qwen2.5-math-7b.yaml [key=value ...] [--recorded RUN_DIR]
        [--tokens-per-second X]                  (reads the recipe: recipes/estimate.py; the arithmetic: here)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from megatron_rlvr.errors import UserError
from megatron_rlvr.eval.bootstrap import DEFAULT_LEVEL, normal_quantile

if TYPE_CHECKING:
    from megatron_rlvr.eval.config import EvalConfig
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.rollout.config import RolloutConfig

TIMING_FILE = "timing.jsonl"
# problem counts of the published benchmarks, used only when the data directory is not on this machine
PUBLISHED_SIZES = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "gsm8k": 1319, "humanevalplus": 164}


class EstimateError(UserError, ValueError):
    """An estimate cannot be made from what was given; the message names the missing input."""


@dataclass(frozen=True)
class Throughput:
    """Measured figures: samples drawn in ``seconds`` (engine start excluded), their tokens, the engine's start."""

    samples: int
    tokens: int
    seconds: float
    startup_seconds: float
    source: str

    @property
    def seconds_per_sample(self) -> float:
        return self.seconds / self.samples

    @property
    def tokens_per_sample(self) -> float:
        return self.tokens / self.samples

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def append_timing(run_dir: str | Path, record: Mapping[str, Any]) -> None:
    """One session's figures, appended (a killed session loses only its own line)."""
    with open(Path(run_dir) / TIMING_FILE, "a") as f:
        f.write(json.dumps(dict(record)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_timing(run_dir: str | Path) -> Throughput | None:
    """The summed figures of every session of a run directory that drew samples, or None."""
    path = Path(run_dir) / TIMING_FILE
    if not path.is_file():
        return None
    sessions = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            sessions.append(
                (
                    int(record["samples"]),
                    int(record["tokens"]),
                    float(record["seconds"]),
                    float(record.get("startup_seconds", 0.0)),
                )
            )
        except (ValueError, KeyError, TypeError):
            continue  # a line cut off by a kill: the other sessions still count
    sessions = [s for s in sessions if s[0] > 0]
    if not sessions:
        return None
    return Throughput(
        sum(s[0] for s in sessions),
        sum(s[1] for s in sessions),
        sum(s[2] for s in sessions),
        sessions[-1][3],
        f"recorded: {path} ({len(sessions)} session(s))",
    )


@dataclass
class ModelEstimate:
    model: str
    samples_total: int
    samples_to_draw: int
    max_new_tokens: int
    throughput: Throughput | None = None
    tokens_per_second: float | None = None  # a user-given figure, used when there is no measured throughput

    @property
    def tokens_bound(self) -> int:
        """Every sample of the whole job at max_new_tokens."""
        return self.samples_total * self.max_new_tokens

    @property
    def tokens_expected(self) -> float | None:
        return self.samples_total * self.throughput.tokens_per_sample if self.throughput else None

    def _wall(self, samples: int) -> float | None:
        if self.throughput is not None:
            return self.throughput.startup_seconds + samples * self.throughput.seconds_per_sample
        if self.tokens_per_second:
            return samples * self.max_new_tokens / self.tokens_per_second
        return None

    @property
    def wall_seconds(self) -> float | None:
        """The whole job from scratch (what a measured run is compared against)."""
        return self._wall(self.samples_total)

    @property
    def remaining_seconds(self) -> float | None:
        """What is left in this output directory (after a calibration or an interrupted run)."""
        return self._wall(self.samples_to_draw) if self.samples_to_draw else 0.0


@dataclass
class JobEstimate:
    benchmarks: dict[str, int]  # name -> problems
    n: int
    models: list[ModelEstimate]
    gpus: int  # 0: CPU
    level: float = DEFAULT_LEVEL
    notes: list[str] = field(default_factory=list)
    # the job's fixed start (interpreter, imports, verifier pool) before its first engine: measured by a calibration
    overhead_seconds: float = 0.0

    @property
    def wall_seconds(self) -> float | None:
        walls = [m.wall_seconds for m in self.models]
        return None if any(w is None for w in walls) else self.overhead_seconds + sum(walls)

    @property
    def remaining_seconds(self) -> float | None:
        walls = [m.remaining_seconds for m in self.models]
        return None if any(w is None for w in walls) else sum(walls)

    @property
    def gpu_hours(self) -> float | None:
        wall = self.wall_seconds
        return None if wall is None or not self.gpus else wall * self.gpus / 3600.0

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmarks": self.benchmarks,
            "n": self.n,
            "gpus": self.gpus,
            "wall_seconds": self.wall_seconds,
            "remaining_seconds": self.remaining_seconds,
            "gpu_hours": self.gpu_hours,
            "interval_halfwidth_bound": {b: halfwidth_bound(p, self.level) for b, p in self.benchmarks.items()},
            "models": [
                {
                    "model": m.model,
                    "samples_total": m.samples_total,
                    "samples_to_draw": m.samples_to_draw,
                    "tokens_bound": m.tokens_bound,
                    "tokens_expected": m.tokens_expected,
                    "wall_seconds": m.wall_seconds,
                    "source": m.throughput.source if m.throughput else None,
                }
                for m in self.models
            ],
        }


def halfwidth_bound(problems: int, level: float = DEFAULT_LEVEL) -> float:
    """The largest half-width (fraction) a pass@k interval over ``problems`` problems can have (normal approx.)."""
    return normal_quantile(0.5 + level / 2.0) * 0.5 / math.sqrt(problems)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def format_estimate(job: JobEstimate) -> str:
    level = f"{100 * job.level:g}%"
    lines = ["| benchmark | problems | n | samples | interval half-width at most |", "|---|---|---|---|---|"]
    for bench, problems in job.benchmarks.items():
        lines.append(
            f"| {bench} | {problems} | {job.n} | {problems * job.n:,} | "
            f"+-{100 * halfwidth_bound(problems, job.level):.1f} points |"
        )
    lines += [
        "",
        "| model | samples | left to draw | tokens at most | tokens expected | whole job | left | figures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in job.models:
        expected = f"{m.tokens_expected:,.0f}" if m.tokens_expected is not None else "-"
        wall = _duration(m.wall_seconds) if m.wall_seconds is not None else "-"
        left = _duration(m.remaining_seconds) if m.remaining_seconds is not None else "-"
        if m.throughput:
            source = (
                f"{m.throughput.source}: {m.throughput.tokens_per_sample:.1f} tokens/sample, "
                f"{m.throughput.tokens_per_second:,.0f} tokens/s, engine start {m.throughput.startup_seconds:.1f} s"
            )
        elif m.tokens_per_second:
            source = f"--tokens-per-second {m.tokens_per_second:g}, every sample at max_new_tokens (upper bound)"
        else:
            source = "none"
        lines.append(
            f"| {Path(m.model).name or m.model} | {m.samples_total:,} | {m.samples_to_draw:,} | "
            f"{m.tokens_bound:,} | {expected} | {wall} | {left} | {source} |"
        )
    lines.append("")
    wall = job.wall_seconds
    if wall is None:
        lines.append(
            "wall time: no figures: run `megatron-rlvr eval --estimate` with the job's flags on its machine "
            "(draws and keeps each model's first request), or give --recorded RUN_DIR (a run of the same "
            "model and settings) or --tokens-per-second"
        )
    else:
        where = f"{job.gpus} GPU(s): {job.gpu_hours:,.1f} GPU-hours" if job.gpus else "CPU: no GPU-hours"
        lines.append(
            f"whole job: {_duration(wall)} wall ({wall:,.0f} s, of which {job.overhead_seconds:.0f} s process "
            f"start before the first engine) on {where}; left in this output directory: "
            f"{_duration(job.remaining_seconds)}"
        )
    from megatron_rlvr.eval.report import k_values

    lines.append(
        f"interval half-width at most: +-1.96 x 0.5 / sqrt(problems) at {level} (a per-problem pass@k lies "
        "in [0, 1]); a paired difference's up to twice that. The table's columns, each cell "
        f"'pass@k [low, high]' (table.csv: pass@k, pass@k_low, pass@k_high):"
    )
    lines += [
        "",
        "| benchmark | model | problems | n | " + " | ".join(f"pass@{k} [{level}]" for k in k_values(job.n)) + " |",
    ]
    lines += job.notes
    return "\n".join(lines) + "\n"


def benchmark_sizes(benchmarks: Sequence[str], data_dir: str, limit: int) -> tuple[dict[str, int], list[str]]:
    """Problems per benchmark from the data files, else the published size (noted), else an error naming it."""
    from megatron_rlvr.problems.benchmarks import load_benchmark

    sizes, notes = {}, []
    for bench in benchmarks:
        try:
            count = len(load_benchmark(bench, data_dir, limit or None))
        except (UserError, OSError, ValueError):
            if bench not in PUBLISHED_SIZES:
                raise EstimateError(
                    f"eval.benchmarks: {bench} has no data under {data_dir} and no published size "
                    f"here; put its file there to count its problems"
                ) from None
            count = min(PUBLISHED_SIZES[bench], limit) if limit else PUBLISHED_SIZES[bench]
            notes.append(f"{bench}: no data under {data_dir} on this machine; its published size, {count} problems")
        sizes[bench] = count
    return sizes, notes


def recorded_throughput(run_dir: str | Path, settings: Mapping[str, Any] | None) -> Throughput:
    """The figures of ``run_dir``, refusing a run of other sampling settings (they change tokens per sample)."""
    from megatron_rlvr.eval.compare import SAMPLING_FIELDS

    run_dir = Path(run_dir)
    throughput = read_timing(run_dir)
    if throughput is None:
        raise EstimateError(f"--recorded {run_dir}: no {TIMING_FILE} with drawn samples there")
    stored_path = run_dir / "run.json"
    if settings is not None and stored_path.is_file():
        stored = json.loads(stored_path.read_text())
        for key in ("model", *SAMPLING_FIELDS):
            if key in settings and stored.get(key) != settings[key]:
                raise EstimateError(
                    f"--recorded {run_dir}: its run differs in {key} (recorded {stored.get(key)!r}, "
                    f"this job {settings[key]!r}); record figures with the same model and settings"
                )
    return throughput


class EvalRecipe(Protocol):
    """The sections of a recipe (a `megatron_rlvr.config.Config`) that its eval job's estimate reads."""

    eval: EvalConfig
    model: ModelConfig
    rollout: RolloutConfig


def recipe_estimate(
    cfg: EvalRecipe, recorded: str | None = None, tokens_per_second: float | None = None, gpus: int | None = None
) -> JobEstimate:
    """The estimate of a recipe's eval job (one model: model.hf_dir), without sampling. ``gpus`` defaults to
    rollout.tp (the job's one engine), or 0 (CPU) for a float32 model, which is what the CPU recipes run."""
    from megatron_rlvr.eval.runner import run_settings

    e = cfg.eval
    if not e.benchmarks:
        raise EstimateError("eval.benchmarks: empty; name at least one benchmark, e.g. eval.benchmarks=[math500]")
    sizes, notes = benchmark_sizes(e.benchmarks, e.data_dir, e.limit)
    total = sum(sizes.values()) * e.n_samples
    throughput = None
    if recorded:
        throughput = recorded_throughput(
            recorded, run_settings(e, str(Path(cfg.model.hf_dir).resolve()), cfg.reward.answer)
        )
    model = ModelEstimate(cfg.model.hf_dir, total, total, e.max_new_tokens, throughput, tokens_per_second)
    if gpus is None:
        gpus = cfg.rollout.tp if cfg.eval.dtype != "float32" else 0
    return JobEstimate(sizes, e.n_samples, [model], gpus, notes=notes)
