"""The CaSP mechanism study's figures (mechanism_report.py builds them from the results folder):

- ``steps_figure``: each probe statistic at every probed step (0 = the base), one thin line per run, a thick line
  per arm (the mean over its seeds), PSR and NSR dashed;
- ``distinct_figure``: E[distinct tokens in K draws] against the rank-1 probability (binned) at the base and at
  each arm's final checkpoints, with the bound ``1 + K (1 - p1)`` (appendix B.2);
- ``passk_figure``: pass@k of the base and each arm (mean over seeds) and CaSP - GRPO pooled with its band.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_rlvr.inspection.mechanism_design import BASE, PAIRED_ARMS, SINGLE_ARMS, probe_label
from megatron_rlvr.monitor.plots import save_figure

if TYPE_CHECKING:
    from megatron_rlvr.inspection.mechanism_results import Results

COLORS = {"grpo": "C0", "casp": "C1", "psr": "C2", "nsr": "C3"}


def _panels(k: int) -> list[tuple[str, str, str]]:
    return [
        ("all", "rank1", "rank-1 probability"),
        ("forking", "rank1", "rank-1 probability (forking)"),
        ("all", "top3", "top-3 mass"),
        ("all", "gap", "rank-1 minus rank-2"),
        ("all", "entropy", "entropy (nats)"),
        ("forking", "entropy", "entropy at forking tokens"),
        ("all", f"distinct@{k}", f"E[distinct in {k} draws]"),
        ("all", "rank3_below", "share with rank-3 < 0.05"),
        ("all", "rare", "rare correct: log-prob / token"),
    ]


def steps_figure(res: Results, path: Path) -> Path:
    from megatron_rlvr.monitor.plots import pyplot

    plt = pyplot()
    d = res.design
    panels = _panels(d.ks[0])
    fig, grid = plt.subplots(3, 3, figsize=(12, 10))
    everything = np.arange(res.prompts)
    runs = d.runs()
    for ax, (scope, name, title) in zip(grid.flat, panels):
        for arm in (*PAIRED_ARMS, *SINGLE_ARMS):
            series = []
            for run_arm, _, run in runs:
                if run_arm != arm:
                    continue
                steps, values = [], []
                for step in d.probe_steps():
                    q = res.quantity(probe_label(run, step), scope, name)
                    if q is not None:
                        steps.append(step)
                        values.append(q(everything))
                if steps:
                    series.append((steps, values))
                    single = arm in SINGLE_ARMS
                    ax.plot(
                        steps,
                        values,
                        "--" if single else "-",
                        color=COLORS[arm],
                        lw=1.5 if single else 0.7,
                        alpha=1.0 if single else 0.5,
                        label=arm if single else None,
                    )
            full = [v for s, v in series if s == d.probe_steps()]
            if arm in PAIRED_ARMS and full:
                ax.plot(
                    d.probe_steps(),
                    np.mean(full, axis=0),
                    "-o",
                    color=COLORS[arm],
                    lw=2.2,
                    markersize=3,
                    label=f"{arm} (mean of {len(full)})",
                )
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    grid.flat[0].legend(fontsize=7)
    fig.suptitle("the fixed probe over training (the base's responses, teacher-forced)", fontsize=10)
    return save_figure(fig, path)


def distinct_figure(res: Results, path: Path) -> Path:
    from megatron_rlvr.monitor.plots import pyplot

    plt = pyplot()
    d = res.design
    fig, axes = plt.subplots(1, len(d.ks), figsize=(5 * len(d.ks), 4), squeeze=False)
    groups: dict[str, list[dict[str, Any]]] = {BASE: [res.probe[BASE]] if BASE in res.probe else []}
    for arm, _, run in d.runs():
        scores = res.probe.get(probe_label(run, d.steps))
        if scores is not None:
            groups.setdefault(arm, []).append(scores)
    for ax, k in zip(axes[0], d.ks):
        for label, members in groups.items():
            if not members:
                continue
            count = np.sum([m["by_rank1"]["count"] for m in members], axis=0)
            total = np.sum([m["by_rank1"][f"distinct@{k}"] for m in members], axis=0)
            bins = len(count)
            centers = (np.arange(bins) + 0.5) / bins
            keep = count > 0
            ax.plot(
                centers[keep],
                total[keep] / count[keep],
                "-o",
                markersize=3,
                color=COLORS.get(label, "k"),
                label=f"{label} ({int(count.sum())} positions)",
            )
        p1 = np.linspace(0, 1, 101)
        ax.plot(p1, np.minimum(k, 1 + k * (1 - p1)), ":", color="gray", label="bound 1 + K(1 - p1)")
        ax.set_xlabel("rank-1 probability")
        ax.set_ylabel(f"E[distinct tokens in {k} draws]")
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def passk_figure(res: Results, table: dict[str, Any], path: Path) -> Path:
    from megatron_rlvr.monitor.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(2, len(table), figsize=(5 * len(table), 7), squeeze=False, sharex="col")
    for j, (bench, t) in enumerate(table.items()):
        ks = t["ks"]
        top, bottom = axes[0][j], axes[1][j]
        for label, curve in t["models"].items():
            arm = label.split("-")[0]
            style = dict(color=COLORS.get(arm, "k"), lw=2.0 if label == BASE else 0.9)
            top.plot(ks, [100 * curve[str(k)]["estimate"] for k in ks], "-o", markersize=3, label=label, **style)
        pooled = t["casp_minus_grpo"]["pooled"]
        if pooled:
            est = [100 * pooled[str(k)]["over_problems"]["estimate"] for k in ks]
            bottom.plot(ks, est, "-o", color="C1", markersize=3, label="CaSP - GRPO (pooled)")
            bottom.fill_between(
                ks,
                [100 * pooled[str(k)]["over_problems"]["low"] for k in ks],
                [100 * pooled[str(k)]["over_problems"]["high"] for k in ks],
                color="C1",
                alpha=0.2,
            )
        bottom.axhline(0, color="gray", lw=0.8)
        top.set_xscale("log", base=2)
        top.set_title(f"{bench}: pass@k (%)", fontsize=9)
        top.legend(fontsize=6)
        bottom.set_xlabel("k")
        bottom.set_ylabel("points")
        bottom.legend(fontsize=7)
    return save_figure(fig, path)
