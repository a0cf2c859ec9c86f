"""`megatron-rlvr demo report --runs OUT1 OUT2 ...`: one markdown table over finished demo runs, grouped by what
set them apart (the algorithm and the recipe overrides), with the mean and the min-max over each group's runs.

    megatron-rlvr demo report --runs outputs/casp_s1 outputs/casp_s2 outputs/grpo_s1 [--group-by algo] [--out t.md]

Each run folder is what `megatron-rlvr demo --out DIR` leaves: ``report/results.json`` (the numbers, written by
report.py) and ``train/config.yaml`` (the run's full config). A run's label is its ``algo.loss`` plus every key
where its config differs from the demo recipe, except the seed (what a group's runs vary) and paths; ``--group-by``
names the keys to group by instead (``algo`` for ``algo.loss``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from megatron_rlvr.errors import UserError

RESULTS = Path("report") / "results.json"
CONFIG = Path("train") / "config.yaml"
SEED_KEY = "trainer.seed"
# where a run put its files, not how it trained: never part of a label
PATH_KEYS = {"model.hf_dir", "model.load", "trainer.output_dir", "eval.output_dir", "checkpoint.resume"}
ALIASES = {"algo": "algo.loss", "seed": SEED_KEY}


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
        raise MultiRunError(f"--runs {path}: no finished demo run (no {RESULTS}); run `megatron-rlvr demo --out {path}`")
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
        return {"pass_at_k": {k: float(m["pass_at_k"][str(k)]) for k in ks},
                "distinct_correct": float(m["mean_distinct_correct"]), "solved": len(_solved(per_prompt[label]))}

    base_solved, trained_solved = _solved(per_prompt[base]), _solved(per_prompt[trained])
    t = numbers(trained)
    return RunStats(path=path, config=config, trained_label=trained, pass_at_k=t["pass_at_k"],
                    distinct_correct=t["distinct_correct"], solved=t["solved"], gained=len(trained_solved - base_solved),
                    lost=len(base_solved - trained_solved), base=numbers(base))


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
        return ", ".join(f"{k}={_fmt(run.config.get(k))}" if k != "algo.loss" else str(run.config.get(k))
                         for k in group_by)
    changed = [f"{k}={_fmt(v)}" for k, v in sorted(run.config.items())
               if k in recipe and k not in PATH_KEYS | {SEED_KEY, "algo.loss"} and v != recipe[k]]
    return ", ".join([str(run.config.get("algo.loss", run.trained_label)), *changed])


def _cell(values: Sequence[float], scale: float = 1.0, digits: int = 1, range_digits: int | None = None) -> str:
    """``mean (min-max)``, or the one value when the runs agree (or there is one run); counts: range_digits=0."""
    values = [v * scale for v in values]
    mean = sum(values) / len(values)
    rd = digits if range_digits is None else range_digits
    if len(values) == 1 or max(values) - min(values) < 0.5 * 10 ** -digits:
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
        "| model | runs | seeds | " + " | ".join(f"pass@{k}" for k in ks)
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
    return "\n".join(lines + [
        "",
        "pass@k in percent; each cell is the mean over the group's runs and, where they differ, (min-max). "
        "distinct correct: mean distinct correct answers per prompt; solved: prompts solved at least once in the "
        "eval's samples; gained / lost: prompts the trained model solved and its run's base did not, and the reverse.",
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rlvr demo report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", required=True, help="finished demo output folders (--out of each run)")
    parser.add_argument("--group-by", nargs="+", default=[],
                        help="config keys to group by (algo = algo.loss); default: algo plus the recipe overrides")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    text = table([read_run(p) for p in args.runs], args.group_by)
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0
