"""The real-model table and candidate-dynamics figure of docs/real-model.md ("CaSP and GRPO on the real model"), from finished runs: each
training run's metrics.jsonl and each model's `megatron-rlvr eval` run directory (its results.json).

    .venv/bin/python tools/reports/real_model_report.py --base outputs/smollm2-arith/eval/base \
        --run GRPO s1 outputs/smollm2-arith/grpo_s1 outputs/smollm2-arith/eval/grpo_s1 \
        --run CaSP s1 outputs/smollm2-arith/casp_s1 outputs/smollm2-arith/eval/casp_s1 \
        --figure docs/real_model_dynamics.png

Prints two markdown tables: pass@k [95% bootstrap interval over problems] of the base and of every run, with the
problems solved (at least one correct of n), gained and lost against the base, and seconds per step (the mean of
steps 2.., split into rollout+reward / statistics / update / sync); then each run's paired difference to the base
at k = 1 and the largest k (`megatron-rlvr eval compare`'s interval: *, it excludes 0). Every eval run must share
the base's problems, n and sampling settings (`eval compare`'s rules).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_rlvr.eval.bootstrap import IntervalSpec, bootstrap_pass_at_k, paired_difference  # noqa: E402
from megatron_rlvr.eval.compare import check_comparable  # noqa: E402
from megatron_rlvr.eval.report import k_values  # noqa: E402
from megatron_rlvr.eval.results import load_run  # noqa: E402
from megatron_rlvr.monitor.plots import plot_candidate_dynamics  # noqa: E402
from megatron_rlvr.monitor.sinks import read_metrics  # noqa: E402

PHASES = ("rollout+reward", "statistics", "update", "sync")


def pct(iv, signed: bool = False) -> str:
    fmt = "+.1f" if signed else ".1f"
    return f"{100 * iv.estimate:{fmt}} [{100 * iv.low:{fmt}}, {100 * iv.high:{fmt}}]"


def seconds_per_step(records: list[dict]) -> str:
    steps = [r for r in records if r.get("step", 0) >= 2 and "time/update" in r]
    if not steps:
        return "-"
    parts = [float(np.mean([r.get(f"time/{p}", 0.0) for r in steps])) for p in PHASES]
    return f"{sum(parts):.0f} ({' / '.join(f'{p:.0f}' for p in parts)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the base model's eval run directory (or its results.json)")
    parser.add_argument(
        "--run",
        nargs=4,
        action="append",
        default=[],
        metavar=("GROUP", "LABEL", "TRAIN_DIR", "EVAL_DIR"),
        help="a trained run: its group (e.g. the loss), its label (e.g. the seed), its trainer.output_dir and its "
        "model's eval run directory",
    )
    parser.add_argument("--figure", help="write the candidate-dynamics PNG here")
    args = parser.parse_args(argv)
    spec = IntervalSpec()
    base = load_run(args.base)
    (bench,) = base.benchmarks
    b = base.benchmarks[bench]
    ks = k_values(b.samples_per_problem(str(base.source)))
    runs = []
    for group, label, train_dir, eval_dir in args.run:
        run = load_run(eval_dir)
        check_comparable(base, run)
        runs.append(
            (f"{group} {label}", group, label, run.benchmarks[bench], read_metrics(Path(train_dir) / "metrics.jsonl"))
        )
    header = [
        "model",
        *(f"pass@{k}" for k in ks),
        "solved",
        "gained / lost",
        "s/step (rollout / statistics / update / sync)",
    ]
    print(f"{bench}: {len(b.problem_ids)} problems, n = {int(b.n[0])} samples each; pass@k in percent [95% interval]\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    rows = [("base", b, None)] + [(name, counts, records) for name, _, _, counts, records in runs]
    for name, counts, records in rows:
        curve = bootstrap_pass_at_k(counts.n, counts.c, ks, spec, stream=bench)
        solved = counts.c > 0
        gained = lost = "-"
        if records is not None:
            gained = str(int(np.sum(solved & (b.c == 0))))
            lost = str(int(np.sum(~solved & (b.c > 0))))
        cells = [name, *(pct(curve[k]) for k in ks), f"{int(solved.sum())} of {len(solved)}"]
        cells += [f"{gained} / {lost}" if records is not None else "-", seconds_per_step(records or [])]
        print("| " + " | ".join(cells) + " |")
    print(f"\n| run | pass@1 minus base [95%, paired] | pass@{ks[-1]} minus base [95%, paired] |\n|---|---|---|")
    for name, _, _, counts, _ in runs:
        diff = paired_difference(b.n, b.c, counts.n, counts.c, [1, ks[-1]], spec, stream=bench)
        marks = ["*" if diff[k].low > 0 or diff[k].high < 0 else "" for k in (1, ks[-1])]
        print(f"| {name} | {pct(diff[1], True)}{marks[0]} | {pct(diff[ks[-1]], True)}{marks[1]} |")
    if args.figure:
        groups: dict[str, dict[str, list[dict]]] = {}
        for _, group, label, _, records in runs:
            groups.setdefault(group, {})[label] = records
        path = plot_candidate_dynamics(groups, args.figure, title="SmolLM2-135M-Instruct, basic_arithmetic")
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
