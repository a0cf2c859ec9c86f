"""`megatron-rlvr demo report --runs OUT1 OUT2 ...`: one markdown table over finished demo runs, grouped by what
set them apart (the algorithm and the recipe overrides), with the mean and the min-max over each group's runs.

    megatron-rlvr demo report --runs outputs/casp_s1 outputs/casp_s2 outputs/grpo_s1 [--group-by algo] [--out t.md]

Each run folder is what `megatron-rlvr demo --out DIR` leaves: ``report/results.json`` (the numbers, written by
report.py) and ``train/config.yaml`` (the run's full config). A run's label is its ``algo.loss.kind`` plus every key
where its config differs from the demo recipe, except the seed (what a group's runs vary) and paths; ``--group-by``
names the keys to group by instead (``algo`` for ``algo.loss.kind``).

A second table gives, at the ``--ks`` columns, each group's pass@k with a 95% bootstrap interval over the eval prompts
and its paired difference to the base and to the first group (megatron_rlvr/eval/bootstrap.py, the machinery of
`megatron-rlvr eval compare`). A group of several runs is the per-prompt mean over its runs: its interval covers
which prompts were drawn, not what another training seed would do (that spread is the first table's min-max). The
runs must share the eval prompts and n (a one-line error names what differs): the demo fixes both.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from megatron_rlvr.errors import UserError
from megatron_rlvr.eval.bootstrap import Interval, IntervalSpec, bootstrap_values, per_problem_pass_at_k

RESULTS = Path("report") / "results.json"
CONFIG = Path("train") / "config.yaml"
SEED_KEY = "trainer.seed"
# where a run put its files, not how it trained: never part of a label
PATH_KEYS = {"model.hf_dir", "model.load", "trainer.output_dir", "eval.output_dir", "checkpoint.resume"}
ALIASES = {"algo": "algo.loss.kind", "seed": SEED_KEY}


class MultiRunError(UserError, ValueError):
    """A --runs folder is not a finished demo run, or its files do not hold what the table needs."""


@dataclass
class RunStats:
    path: Path
    config: dict[str, Any]  # dotted key -> value ({} when the run has no config.yaml)
    trained_label: str
    pass_at_k: dict[int, float]
    distinct_correct: float
    solved: int
    gained: int
    lost: int
    base: dict[str, Any] = field(default_factory=dict)  # the same numbers of the run's base model
    counts: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)  # "trained"/"base" -> prompt -> (n, c)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name))
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def _solved(per_prompt: Mapping[str, Mapping[str, Any]]) -> set[str]:
    return {pid for pid, s in per_prompt.items() if s.get("correct", 0) > 0}


def read_run(path: str | Path) -> RunStats:
    """The numbers of one finished demo run: its trained model against its base (the first model of results.json)."""
    path = Path(path)
    results_file = path / RESULTS
    if not results_file.is_file():
        raise MultiRunError(
            f"--runs {path}: no finished demo run (no {RESULTS}); run `megatron-rlvr demo --out {path}`"
        )
    try:
        results = json.loads(results_file.read_text())
        labels = list(results["models"])
        models, per_prompt, ks = results["models"], results["per_prompt"], [int(k) for k in results["ks"]]
    except (ValueError, KeyError, TypeError) as e:
        raise MultiRunError(f"{results_file}: expected report.py's results.json (ks, models, per_prompt): {e!r}") from e
    if len(labels) < 2:
        raise MultiRunError(f"{results_file}: holds {labels}; expected the base and a trained model")
    base, trained = labels[0], labels[1]
    config: dict[str, Any] = {}
    if (path / CONFIG).is_file():
        config = flatten(yaml.safe_load((path / CONFIG).read_text()) or {})

    def numbers(label: str) -> dict[str, Any]:
        m = models[label]
        return {
            "pass_at_k": {k: float(m["pass_at_k"][str(k)]) for k in ks},
            "distinct_correct": float(m["mean_distinct_correct"]),
            "solved": len(_solved(per_prompt[label])),
        }

    base_solved, trained_solved = _solved(per_prompt[base]), _solved(per_prompt[trained])
    t = numbers(trained)
    try:
        counts = {
            role: {str(pid): (int(s["n"]), int(s["correct"])) for pid, s in per_prompt[label].items()}
            for role, label in (("trained", trained), ("base", base))
        }
    except (KeyError, TypeError, ValueError) as e:
        raise MultiRunError(f"{results_file}: per_prompt entries need n and correct: {e!r}") from e
    return RunStats(
        path=path,
        config=config,
        trained_label=trained,
        pass_at_k=t["pass_at_k"],
        distinct_correct=t["distinct_correct"],
        solved=t["solved"],
        gained=len(trained_solved - base_solved),
        lost=len(base_solved - trained_solved),
        base=numbers(base),
        counts=counts,
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return str(value)


def recipe_values() -> dict[str, Any]:
    """The demo recipe's full config (dotted keys): what a run's overrides are measured against."""
    from megatron_rlvr.config import load_config, to_dict
    from megatron_rlvr.demo import RECIPE

    return flatten(to_dict(load_config(RECIPE)))


def label_of(run: RunStats, recipe: Mapping[str, Any], group_by: Sequence[str] = ()) -> str:
    if not run.config:  # no config.yaml: the name the report gave the trained model
        return run.trained_label
    if group_by:
        return ", ".join(
            f"{k}={_fmt(run.config.get(k))}" if k != "algo.loss.kind" else str(run.config.get(k)) for k in group_by
        )
    changed = [
        f"{k}={_fmt(v)}"
        for k, v in sorted(run.config.items())
        if k in recipe and k not in PATH_KEYS | {SEED_KEY, "algo.loss.kind"} and v != recipe[k]
    ]
    return ", ".join([str(run.config.get("algo.loss.kind", run.trained_label)), *changed])


def _cell(values: Sequence[float], scale: float = 1.0, digits: int = 1, range_digits: int | None = None) -> str:
    """``mean (min-max)``, or the one value when the runs agree (or there is one run); counts: range_digits=0."""
    values = [v * scale for v in values]
    mean = sum(values) / len(values)
    rd = digits if range_digits is None else range_digits
    if len(values) == 1 or max(values) - min(values) < 0.5 * 10**-digits:
        return f"{mean:.{rd}f}"
    return f"{mean:.{digits}f} ({min(values):.{rd}f}-{max(values):.{rd}f})"


def table(runs: Sequence[RunStats], group_by: Sequence[str] = ()) -> str:
    """Markdown: the base row, then one row per group: mean (min-max) over its runs."""
    if not runs:
        raise MultiRunError("--runs: give at least one finished demo run folder")
    group_by = [ALIASES.get(k, k) for k in group_by]
    recipe = recipe_values() if any(r.config for r in runs) and not group_by else {}
    groups: dict[str, list[RunStats]] = {}
    for run in runs:
        groups.setdefault(label_of(run, recipe, group_by), []).append(run)
    ks = sorted(set.intersection(*(set(r.pass_at_k) for r in runs)))
    lines = [
        "| model | runs | seeds | "
        + " | ".join(f"pass@{k}" for k in ks)
        + " | distinct correct | solved | gained vs base | lost vs base |",
        "|---|---|---|" + "---|" * (len(ks) + 4),
    ]
    base = [r.base for r in runs]
    cells = [_cell([b["pass_at_k"][k] for b in base], 100) for k in ks]
    cells += [_cell([b["distinct_correct"] for b in base], digits=2), _cell([b["solved"] for b in base], 1, 1, 0)]
    lines.append(f"| base | {len(runs)} | - | " + " | ".join(cells) + " | - | - |")
    for label, members in groups.items():
        seeds = ",".join(_fmt(r.config.get(SEED_KEY, "?")) for r in members)
        cells = [_cell([r.pass_at_k[k] for r in members], 100) for k in ks]
        cells += [_cell([r.distinct_correct for r in members], digits=2)]
        # prompt counts: the mean to one decimal, the range in whole prompts
        cells += [_cell([getattr(r, name) for r in members], 1, 1, 0) for name in ("solved", "gained", "lost")]
        lines.append(f"| {label} | {len(members)} | {seeds} | " + " | ".join(cells) + " |")
    return (
        "\n".join(
            lines
            + [
                "",
                "pass@k in percent; each cell is the mean over the group's runs and, where they differ, (min-max). "
                "distinct correct: mean distinct correct answers per prompt; solved: prompts solved at least once in the "
                "eval's samples; gained / lost: prompts the trained model solved and its run's base did not, and the reverse.",
            ]
        )
        + "\n"
    )


def _check_same_prompts(runs: Sequence[RunStats]) -> list[str]:
    """The prompt order of the first run; a MultiRunError naming the run and what differs otherwise."""
    first = runs[0].counts["base"]
    for run in runs:
        for role in ("base", "trained"):
            mine = run.counts[role]
            if set(mine) != set(first):
                only = sorted(set(mine) ^ set(first))[:3]
                raise MultiRunError(
                    f"--runs {run.path}: its {role} model was evaluated on other prompts than "
                    f"{runs[0].path}'s base (e.g. {only}); intervals need the same eval prompts"
                )
            n_mine, n_first = {n for n, _ in mine.values()}, {n for n, _ in first.values()}
            if n_mine != n_first:
                raise MultiRunError(
                    f"--runs {run.path}: its {role} model drew n = {sorted(n_mine)} samples per prompt, "
                    f"{runs[0].path}'s base {sorted(n_first)}; intervals need the same n"
                )
    return list(first)


def _mean_values(members: Sequence[RunStats], role: str, order: Sequence[str], ks: Sequence[int]) -> np.ndarray:
    """Per prompt (in ``order``), pass@k averaged over the runs: (prompts, len(ks))."""
    per_run = [
        per_problem_pass_at_k(
            np.array([r.counts[role][p][0] for p in order]), np.array([r.counts[role][p][1] for p in order]), ks
        )
        for r in members
    ]
    return np.mean(per_run, axis=0)


def _iv(iv: Interval, signed: bool = False) -> str:
    fmt = "+.1f" if signed else ".1f"
    mark = "*" if signed and (iv.low > 0 or iv.high < 0) else ""
    return f"{100 * iv.estimate:{fmt}} [{100 * iv.low:{fmt}}, {100 * iv.high:{fmt}}]{mark}"


def interval_table(
    runs: Sequence[RunStats],
    group_by: Sequence[str] = (),
    ks: Sequence[int] = (),
    spec: IntervalSpec = IntervalSpec(),
    benchmark: str = "countdown",
) -> str:
    """Markdown: per group and k, pass@k [interval], minus the base [paired], minus the first group [paired]."""
    order = _check_same_prompts(runs)
    group_by = [ALIASES.get(k, k) for k in group_by]
    recipe = recipe_values() if any(r.config for r in runs) and not group_by else {}
    groups: dict[str, list[RunStats]] = {}
    for run in runs:
        groups.setdefault(label_of(run, recipe, group_by), []).append(run)
    common = sorted(set.intersection(*(set(r.pass_at_k) for r in runs)))
    ks = [k for k in (ks or (common[0], common[-1])) if k in common]
    if not ks:
        raise MultiRunError(f"--ks: none of them is a k of these runs ({common})")
    base = _mean_values(runs, "base", order, ks)
    values = {label: _mean_values(members, "trained", order, ks) for label, members in groups.items()}
    first = next(iter(values))
    level = f"{100 * spec.level:g}%"
    lines = [
        f"| model | runs | k | pass@k [{level}] | minus base [{level}, paired] | minus {first} [{level}, paired] |",
        "|---|---|---|---|---|---|",
    ]
    base_iv = bootstrap_values(base, ks, spec, benchmark)
    for k in ks:
        lines.append(f"| base | {len(runs)} | {k} | {_iv(base_iv[k])} | - | - |")
    for label, v in values.items():
        own = bootstrap_values(v, ks, spec, benchmark)
        members = groups[label]
        vs_base = bootstrap_values(v - _mean_values(members, "base", order, ks), ks, spec, benchmark + "/paired")
        vs_first = bootstrap_values(v - values[first], ks, spec, benchmark + "/paired") if label != first else None
        for k in ks:
            lines.append(
                f"| {label} | {len(members)} | {k} | {_iv(own[k])} | {_iv(vs_base[k], True)} | "
                f"{_iv(vs_first[k], True) if vs_first else '-'} |"
            )
    return (
        "\n".join(
            lines
            + [
                "",
                f"pass@k in percent over {len(order)} eval prompts; [low, high]: {level} percentile-bootstrap intervals over "
                f"the prompts ({spec.resamples} resamples, seed {spec.seed}), paired: the same resampled prompts on both "
                "sides. A group of several runs enters as its per-prompt mean over the runs. *: the interval excludes 0.",
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rlvr demo report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", required=True, help="finished demo output folders (--out of each run)")
    parser.add_argument(
        "--group-by",
        nargs="+",
        default=[],
        help="config keys to group by (algo = algo.loss.kind); default: algo plus the recipe overrides",
    )
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument(
        "--ks", nargs="+", type=int, default=[], help="k columns of the interval table (default: 1 and the largest)"
    )
    parser.add_argument("--resamples", type=int, default=IntervalSpec().resamples, help="bootstrap resamples")
    parser.add_argument("--interval-seed", type=int, default=IntervalSpec().seed, help="bootstrap seed")
    args = parser.parse_args(argv)
    runs = [read_run(p) for p in args.runs]
    spec = IntervalSpec(resamples=args.resamples, seed=args.interval_seed)
    text = table(runs, args.group_by) + "\n" + interval_table(runs, args.group_by, args.ks, spec)
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0
