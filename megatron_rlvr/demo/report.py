"""The demo's report folder: report.md (pass@k table with 95% intervals, each model against the first with a paired
interval and a sign test, distinct correct answers, prompts solved), results.json and PNGs (pass_at_k.png: the curves
with their interval bands; plus, when the caller made one, a candidate matrix: inspection/candidates.py). The
intervals are megatron_rlvr/eval/bootstrap.py's, seeded by the benchmark's name as in `megatron-rlvr eval`'s table,
so the same samples give the same intervals in both.

Inputs are plain data, so the demo command (or anyone) can call it after training and evaluation:

    write_report("outputs/demo/report",
                 samples={"base": base_results, "trained": trained_results},   # [{prompt_id, sample, response, reward}]
                 metrics={"casp": "outputs/demo/metrics.jsonl"})
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rlvr.eval import pass_at_k
from megatron_rlvr.eval.band_plot import plot_bands
from megatron_rlvr.eval.bootstrap import IntervalSpec, bootstrap_pass_at_k, paired_difference, sign_test
from megatron_rlvr.monitor import plots
from megatron_rlvr.monitor.sinks import HISTOGRAMS_FILE, read_metrics

SAMPLE_KEYS = ("prompt_id", "sample", "response", "reward")
# The sampler-vs-trainer and dynamic-sampling metrics, one panel each in off_policy.png (those a run logged)
OFF_POLICY_KEYS = (
    "rollout_correction/weight_mean",
    "rollout_correction/clipped_frac",
    "rollout_correction/masked_frac",
    "rollout/logp_mismatch",
    "batch/groups_trained",
    "batch/uniform_groups_dropped",
    "batch/refill_rounds",
    "response/truncated_frac",
    "time/rollout+reward",
)


def answer_key(response: str) -> str:
    """What makes two answers the same: the first line without whitespace."""
    return "".join(response.split("\n", 1)[0].split())


def per_prompt(samples: Sequence[Mapping[str, Any]], label: str = "samples") -> dict[str, dict[str, Any]]:
    """prompt_id -> {n, correct, distinct_correct, distinct}; each sample must hold SAMPLE_KEYS."""
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for i, s in enumerate(samples):
        missing = [k for k in SAMPLE_KEYS if k not in s]
        if missing:
            raise ValueError(f"{label}[{i}]: missing {', '.join(missing)}; each sample needs {', '.join(SAMPLE_KEYS)}")
        groups[str(s["prompt_id"])].append(s)
    out = {}
    for pid, group in groups.items():
        correct = [s for s in group if float(s["reward"]) > 0.5]
        out[pid] = {
            "n": len(group),
            "correct": len(correct),
            "distinct_correct": len({answer_key(s["response"]) for s in correct}),
            "distinct": len({answer_key(s["response"]) for s in group}),
        }
    return out


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n (n itself last when it is not a power of two)."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def pass_at_k_curve(stats: Mapping[str, Mapping[str, Any]], ks: Sequence[int]) -> dict[int, float]:
    n = np.array([s["n"] for s in stats.values()])
    c = np.array([s["correct"] for s in stats.values()])
    return {k: float(np.mean(pass_at_k(n, c, np.full_like(n, k)))) for k in ks}


def _counts(per: Mapping[str, Mapping[str, Any]], order: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    pids = list(per) if order is None else order
    return np.array([per[p]["n"] for p in pids]), np.array([per[p]["correct"] for p in pids])


def _paired(
    models: Mapping[str, Mapping[str, Any]], ks: Sequence[int], spec: IntervalSpec, benchmark: str
) -> dict[str, Any]:
    """Each model after the first against the first, on the prompts both answered with the same n: the paired
    difference per k, the discordant prompts (solved at least once by one only) and the exact sign test."""
    labels = list(models)
    first = models[labels[0]]["per_prompt"]
    out = {}
    for label in labels[1:]:
        per = models[label]["per_prompt"]
        if set(per) != set(first) or any(per[p]["n"] != first[p]["n"] for p in first):
            out[label] = {"skipped": f"other prompts or n than {labels[0]}'s: no paired comparison"}
            continue
        order = list(first)
        (n_a, c_a), (n_b, c_b) = _counts(first, order), _counts(per, order)
        a_only, b_only = int(np.sum((c_a > 0) & (c_b == 0))), int(np.sum((c_b > 0) & (c_a == 0)))
        out[label] = {
            "difference": paired_difference(n_a, c_a, n_b, c_b, ks, spec, stream=benchmark),
            "first_only": a_only,
            "this_only": b_only,
            "sign_test_p": sign_test(a_only, b_only),
        }
    return out


def summarize(
    samples: Mapping[str, Sequence[Mapping[str, Any]]],
    spec: IntervalSpec = IntervalSpec(),
    benchmark: str = "countdown",
) -> dict[str, Any]:
    """Per model: the pass@k curve over the common k values with its intervals, distinct-answer counts, and the
    per-prompt rows; and each later model against the first (``paired``)."""
    if not samples:
        raise ValueError("write_report: no sample sets given")
    stats = {label: per_prompt(rows, label) for label, rows in samples.items()}
    for label, per in stats.items():
        if not per:
            raise ValueError(f"write_report: sample set {label!r} is empty")
    n_min = min(s["n"] for per in stats.values() for s in per.values())
    ks = k_values(n_min)
    models = {}
    for label, per in stats.items():
        models[label] = {
            "prompts": len(per),
            "samples_per_prompt": n_min,
            "pass_at_k": pass_at_k_curve(per, ks),
            "pass_at_k_interval": bootstrap_pass_at_k(*_counts(per), ks, spec, stream=benchmark),
            "mean_distinct_correct": float(np.mean([s["distinct_correct"] for s in per.values()])),
            "mean_distinct": float(np.mean([s["distinct"] for s in per.values()])),
            "per_prompt": per,
        }
    return {"ks": ks, "models": models, "paired": _paired(models, ks, spec, benchmark), "intervals": spec}


def _validation_lines(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """A table of each run's in-training validations (records with val/ metrics), or nothing when it had none."""
    lines = []
    for label, records in runs.items():
        validated = [r for r in records if "val/pass@1" in r]
        if not validated:
            continue
        ks = sorted({int(k.split("@")[1]) for r in validated for k in r if k.startswith("val/pass@")})
        lines += [
            f"Run {label!r}: pass@k in percent on the held-out prompts, and the answers' mean token entropy.",
            "",
            "| step | " + " | ".join(f"pass@{k}" for k in ks) + " | entropy |",
            "|---|" + "---|" * (len(ks) + 1),
        ]
        for r in validated:
            cells = " | ".join(f"{100 * r[f'val/pass@{k}']:.1f}" if f"val/pass@{k}" in r else "-" for k in ks)
            lines.append(f"| {r['step']} | {cells} | {r.get('val/entropy', float('nan')):.3f} |")
        lines.append("")
    return ["## Validation during training", "", *lines] if lines else []


def _coverage_lines(models: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Which prompts each model solves at least once in its n samples, against the first model (the base): the
    prompts behind pass@n, gained and lost. The per-prompt counts are in results.json."""
    labels = list(models)
    solved = {label: {pid for pid, s in m["per_prompt"].items() if s["correct"]} for label, m in models.items()}
    base = labels[0]
    lines = [
        "## Prompts solved at least once",
        "",
        f"| model | solved | of | solved, {base} did not | {base} solved, this did not |",
        "|---|---|---|---|---|",
    ]
    for label in labels:
        gained, lost = len(solved[label] - solved[base]), len(solved[base] - solved[label])
        lines.append(f"| {label} | {len(solved[label])} | {models[label]['prompts']} | {gained} | {lost} |")
    return lines + ["", "Per prompt: correct samples, distinct correct and distinct answers in results.json."]


def _interval_cell(iv, signed: bool = False) -> str:
    fmt = "+.1f" if signed else ".1f"
    return f"{100 * iv.estimate:{fmt}} [{100 * iv.low:{fmt}}, {100 * iv.high:{fmt}}]"


def _paired_lines(summary: Mapping[str, Any]) -> list[str]:
    ks, models, paired = summary["ks"], summary["models"], summary["paired"]
    if not paired:
        return []
    first = list(models)[0]
    level = f"{100 * summary['intervals'].level:g}%"
    lines = [
        f"## Against {first}",
        "",
        "| model | "
        + " | ".join(f"pass@{k} - {first}" for k in ks)
        + f" | solved, {first} did not | {first} solved, this did not | sign test p |",
        "|---|" + "---|" * (len(ks) + 3),
    ]
    notes = []
    for label, p in paired.items():
        if "skipped" in p:
            notes.append(f"{label}: {p['skipped']}")
            continue
        cells = " | ".join(_interval_cell(p["difference"][k], True) for k in ks)
        lines.append(f"| {label} | {cells} | {p['this_only']} | {p['first_only']} | {p['sign_test_p']:.3g} |")
    return lines + [
        "",
        f"Points of pass@k with a paired {level} bootstrap interval (the same resampled prompts for "
        "both models); an interval that excludes 0 separates the two. The sign test (exact, "
        "two-sided) is on the prompts solved at least once by one model only.",
        *notes,
    ]


def _candidate_lines(candidates: Mapping[str, Any] | None) -> list[str]:
    if not candidates:
        return []
    path = Path(candidates["path"])
    return ["## Candidate matrix", "", str(candidates.get("caption", "")), "", f"![{path.stem}]({path.name})"]


def _markdown(
    summary: dict[str, Any],
    figures: list[Path],
    title: str,
    notes: Sequence[str],
    validation: Sequence[str] = (),
    candidates: Mapping[str, Any] | None = None,
) -> str:
    ks, models = summary["ks"], summary["models"]
    lines = [f"# {title}", ""]
    lines += [f"- {note}" for note in notes]
    if notes:
        lines.append("")
    spec = summary["intervals"]
    level = f"{100 * spec.level:g}%"
    lines += [
        "## pass@k",
        "",
        "| model | prompts | n | " + " | ".join(f"pass@{k} [{level}]" for k in ks) + " |",
        "|---|---|---|" + "---|" * len(ks),
    ]
    for label, m in models.items():
        cells = " | ".join(_interval_cell(m["pass_at_k_interval"][k]) for k in ks)
        lines.append(f"| {label} | {m['prompts']} | {m['samples_per_prompt']} | {cells} |")
    lines += [
        "",
        "pass@k in percent: the unbiased estimator 1 - C(n-c, k)/C(n, k), averaged over prompts; [low, high]: "
        f"its {level} percentile-bootstrap interval over prompts ({spec.resamples} resamples, seed {spec.seed}; "
        "docs/eval-statistics.md).",
        "",
    ]
    paired = _paired_lines(summary)
    if paired:
        lines += [*paired, ""]
    lines += [
        "## Distinct answers per prompt",
        "",
        "| model | mean distinct correct answers | mean distinct answers |",
        "|---|---|---|",
    ]
    for label, m in models.items():
        lines.append(f"| {label} | {m['mean_distinct_correct']:.2f} | {m['mean_distinct']:.2f} |")
    lines += ["", *_coverage_lines(models)]
    if validation:
        lines += ["", *validation]
    if candidates:
        lines += ["", *_candidate_lines(candidates)]
    if figures:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in figures]
    return "\n".join(lines) + "\n"


def write_report(
    out_dir: str | os.PathLike,
    samples: Mapping[str, Sequence[Mapping[str, Any]]],
    metrics: Mapping[str, str | os.PathLike] | str | os.PathLike | None = None,
    title: str = "megatron-rlvr demo: countdown",
    notes: Sequence[str] = (),
    candidates: Mapping[str, Any] | None = None,
    spec: IntervalSpec = IntervalSpec(),
    benchmark: str = "countdown",
) -> dict[str, Any]:
    """Write report.md, results.json and the plots into ``out_dir``; return the summary (with ``files``).

    ``samples``: model label -> per-sample results; ``metrics``: run label -> metrics.jsonl path (a bare path is
    labelled "train"); a histograms.jsonl beside a metrics file is plotted too. ``candidates``: a candidate matrix
    already rendered into ``out_dir`` ({path, caption, and what results.json should keep: prompt_id, prompt,
    response}); report.md links it. ``benchmark``: what the samples are of; its name seeds the interval resampling.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(samples, spec, benchmark)
    if metrics is not None and not isinstance(metrics, Mapping):
        metrics = {"train": metrics}
    runs, hists = {}, []
    for label, path in (metrics or {}).items():
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"write_report: metrics file {path} (run {label!r}) not found")
        runs[label] = read_metrics(path)
        hist_path = path.parent / HISTOGRAMS_FILE
        if hist_path.is_file():
            hists += [
                dict(h, label=f"{label}: {h.get('name', 'entropy')} @ step {h.get('step')}")
                for h in read_metrics(hist_path)
            ]
    bands = {label: m["pass_at_k_interval"] for label, m in summary["models"].items()}
    labels = list(bands)
    second = summary["paired"].get(labels[1], {}) if len(labels) > 1 else {}
    figures = [
        plot_bands(
            bands,
            out / "pass_at_k.png",
            f"{benchmark}: pass@k",
            spec.level,
            difference=second.get("difference"),
            difference_label=f"{labels[-1]} - {labels[0]}",
        ),
        plots.plot_runs(runs, "reward", "mean reward", out / "reward.png") if runs else None,
        plots.plot_rank_probs(runs, out / "rank_probs.png") if runs else None,
        plots.plot_entropy(runs, out / "entropy.png") if runs else None,
        plots.plot_entropy_histograms(hists, out / "entropy_hist.png"),
        plots.plot_metric_panels(runs, OFF_POLICY_KEYS, out / "off_policy.png") if runs else None,
    ]
    figures = [f for f in figures if f is not None]
    if candidates and Path(candidates["path"]).resolve().parent != out.resolve():
        raise ValueError(
            f"write_report: the candidate matrix {candidates['path']} must lie in {out} (report.md links it)"
        )
    (out / "report.md").write_text(_markdown(summary, figures, title, notes, _validation_lines(runs), candidates))
    results = {
        "ks": summary["ks"],
        "models": {
            label: {
                **{k: v for k, v in m.items() if k not in ("per_prompt", "pass_at_k_interval")},
                "pass_at_k_interval": {str(k): iv.to_json() for k, iv in m["pass_at_k_interval"].items()},
            }
            for label, m in summary["models"].items()
        },
        "per_prompt": {label: m["per_prompt"] for label, m in summary["models"].items()},  # n, correct: every figure
        "intervals": {**spec.to_json(), "stream": benchmark},
        "paired": {
            label: {
                k: ({str(kk): iv.to_json() for kk, iv in v.items()} if k == "difference" else v) for k, v in p.items()
            }
            for label, p in summary["paired"].items()
        },
    }
    if candidates:
        results["candidates"] = {
            k: (Path(v).name if k == "path" else v) for k, v in candidates.items() if k != "caption"
        }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    summary["files"] = [out / "report.md", out / "results.json"] + figures
    summary["files"] += [Path(candidates["path"])] if candidates else []
    return summary
