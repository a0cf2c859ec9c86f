"""The CaSP mechanism study's pass@k table (docs/casp-mechanism.md, "Analysis plan"): each model's pass@k with its
interval over problems, CaSP - GRPO paired per seed pair and pooled (over problems: the per-problem mean over the
pairs; over seeds: the t-interval of the pairs' differences), and each arm's mean over seeds against the base. The
intervals are the eval's (eval/bootstrap.py); runs that differ in problems, n or sampling are refused as
`megatron-rlvr eval compare` refuses them."""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_rlvr.eval.bootstrap import IntervalSpec, bootstrap_values, paired_difference, per_problem_pass_at_k
from megatron_rlvr.inspection import mechanism_stats as ms
from megatron_rlvr.inspection.mechanism_design import BASE, PAIRED_ARMS
from megatron_rlvr.inspection.mechanism_results import Results


def _counts(res: Results, label: str, bench: str):
    run = res.evals.get(label)
    if run is None or bench not in run.benchmarks:
        return None
    return run.benchmarks[bench]


def passk(res: Results, spec: IntervalSpec = IntervalSpec()) -> dict[str, Any]:
    """Per benchmark: each model's pass@k, CaSP - GRPO paired per seed pair and pooled (over problems: the
    per-problem mean over pairs; over seeds: the t-interval), each arm pooled against the base."""
    from megatron_rlvr.eval.compare import check_comparable

    d = res.design
    out: dict[str, Any] = {}
    benches = sorted({b for run in res.evals.values() for b in run.benchmarks})
    for bench in benches:
        labels = [label for label in res.evals if _counts(res, label, bench) is not None]
        first = res.evals[labels[0]]
        for label in labels[1:]:
            check_comparable(
                first, res.evals[label]
            )  # same problems, n and sampling, or one line naming the difference
        ks = [k for k in d.pass_ks if k <= int(_counts(res, labels[0], bench).n.min())]
        models = {
            label: {
                str(k): iv.to_json()
                for k, iv in bootstrap_values(per_problem_pass_at_k(c.n, c.c, ks), ks, spec, bench).items()
            }
            for label in labels
            for c in [_counts(res, label, bench)]
        }
        pairs, diffs = [], []
        for seed, names in d.paired_runs():
            g, c = _counts(res, names["grpo"], bench), _counts(res, names["casp"], bench)
            if g is None or c is None:
                continue
            per_pair = paired_difference(g.n, g.c, c.n, c.c, ks, spec, f"{bench}/s{seed}")
            pairs.append({"seed": seed, **{str(k): iv.to_json() for k, iv in per_pair.items()}})
            diffs.append(per_problem_pass_at_k(c.n, c.c, ks) - per_problem_pass_at_k(g.n, g.c, ks))
        pooled = {}
        if diffs:
            over_problems = bootstrap_values(np.mean(diffs, axis=0), ks, spec, f"{bench}/pooled")
            for j, k in enumerate(ks):
                seeds = ms.seed_interval([float(x[:, j].mean()) for x in diffs], spec.level)
                pooled[str(k)] = {"over_problems": over_problems[k].to_json(), "over_seeds": seeds.to_json()}
        vs_base = {}
        base = _counts(res, BASE, bench)
        for arm in PAIRED_ARMS:
            runs = [_counts(res, names[arm], bench) for _, names in d.paired_runs()]
            runs = [r for r in runs if r is not None]
            if base is None or not runs:
                continue
            arm_mean = np.mean([per_problem_pass_at_k(r.n, r.c, ks) for r in runs], axis=0)
            delta = bootstrap_values(arm_mean - per_problem_pass_at_k(base.n, base.c, ks), ks, spec, f"{bench}/{arm}")
            vs_base[arm] = {str(k): iv.to_json() for k, iv in delta.items()}
        out[bench] = {
            "ks": ks,
            "models": models,
            "casp_minus_grpo": {"pairs": pairs, "pooled": pooled},
            "vs_base": vs_base,
            "problems": len(first.benchmarks[bench].problem_ids),
        }
    return out


def passk_markdown(table: dict[str, Any]) -> str:
    parts = []
    for bench, t in table.items():
        ks = t["ks"]
        parts.append(f"### {bench} ({t['problems']} problems), pass@k in percent [95% over problems]\n")
        parts.append("| model | " + " | ".join(f"k={k}" for k in ks) + " |")
        parts.append("|---|" + "---|" * len(ks))
        for label, curve in t["models"].items():
            parts.append(
                f"| {label} | " + " | ".join(ms.interval_text(curve[str(k)], 1, 100, signed=False) for k in ks) + " |"
            )
        for p in t["casp_minus_grpo"]["pairs"]:
            parts.append(
                f"| CaSP - GRPO, seed {p['seed']} (paired) | "
                + " | ".join(ms.interval_text(p[str(k)], 1, 100) for k in ks)
                + " |"
            )
        pooled = t["casp_minus_grpo"]["pooled"]
        if pooled:
            parts.append(
                "| CaSP - GRPO, pooled [over problems] | "
                + " | ".join(ms.interval_text(pooled[str(k)]["over_problems"], 1, 100) for k in ks)
                + " |"
            )
            parts.append(
                "| CaSP - GRPO, pooled [over seeds, t] | "
                + " | ".join(ms.interval_text(pooled[str(k)]["over_seeds"], 1, 100) for k in ks)
                + " |"
            )
        for arm, curve in t["vs_base"].items():
            parts.append(
                f"| {arm} (mean over seeds) - base | "
                + " | ".join(ms.interval_text(curve[str(k)], 1, 100) for k in ks)
                + " |"
            )
        parts.append("")
    return "\n".join(parts) + "\n"
