"""PNG plots of a run (matplotlib, Agg backend): reward, rank-k probability dynamics, entropy, entropy histograms,
pass@k curves. Each function writes one file and returns its path, or None when the inputs hold nothing to plot.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_rlvr.monitor.dynamics import candidate_dynamics


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: never a display
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` (its folder made), close it; the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_reward(records: Sequence[Mapping[str, Any]], path: str | os.PathLike, label: str = "") -> Path | None:
    return plot_runs({label or "run": records}, "reward", "mean reward", path)


def plot_runs(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], series_name: str, ylabel: str, path: str | os.PathLike
) -> Path | None:
    """One series (a key of :func:`candidate_dynamics`) for several runs on one axis."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for label, records in runs.items():
        dyn = candidate_dynamics(records)
        if series_name in dyn:
            ax.plot(*dyn[series_name], marker=".", label=label)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, Path(path))


def plot_rank_probs(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | os.PathLike) -> Path | None:
    """Rank-1/2/3 probabilities over steps (solid: all response tokens; dashed: high-entropy tokens), per run."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    drawn = False
    for label, records in runs.items():
        dyn = candidate_dynamics(records)
        for k, ax in zip((1, 2, 3), axes):
            if f"rank{k}_prob" in dyn:
                line = ax.plot(*dyn[f"rank{k}_prob"], label=f"{label}")[0]
                drawn = True
                if f"rank{k}_prob_high_entropy" in dyn:
                    ax.plot(
                        *dyn[f"rank{k}_prob_high_entropy"],
                        linestyle="--",
                        color=line.get_color(),
                        label=f"{label} (forking tokens)",
                    )
    if not drawn:
        plt.close(fig)
        return None
    for k, ax in zip((1, 2, 3), axes):
        ax.set_title(f"rank-{k} probability")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save_figure(fig, Path(path))


DYNAMICS_PANELS = (
    ("reward", "mean reward"),
    ("rank1_prob", "rank-1 probability"),
    ("top3_mass", "top-3 mass (rank 1 + 2 + 3)"),
    ("entropy", "entropy (nats)"),
    ("rank1_prob_high_entropy", "rank-1 probability, forking tokens"),
    ("top3_mass_high_entropy", "top-3 mass, forking tokens"),
)


def plot_candidate_dynamics(
    groups: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], path: str | os.PathLike, title: str = ""
) -> Path | None:
    """Candidate dynamics of several runs (metrics.jsonl records) in six panels: reward, rank-1 probability, top-3
    mass and entropy over all response tokens, and rank-1 probability and top-3 mass over the high-entropy (forking)
    tokens. ``groups``: a label (e.g. the loss) -> its runs (e.g. one per seed); a group's runs share a colour and
    differ in line style. None when no run logged any of these series."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")
    drawn = False
    for g, (group, runs) in enumerate(groups.items()):
        for r, (label, records) in enumerate(runs.items()):
            dyn = candidate_dynamics(records)
            for ax, (name, _) in zip(axes.flat, DYNAMICS_PANELS):
                if name in dyn:
                    colour, style = colours[g % len(colours)], styles[r % len(styles)]
                    ax.plot(*dyn[name], color=colour, linestyle=style, linewidth=1.3, label=f"{group} {label}")
                    drawn = True
    if not drawn:
        plt.close(fig)
        return None
    for ax, (_, ylabel) in zip(axes.flat, DYNAMICS_PANELS):
        ax.set_title(ylabel, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    return save_figure(fig, Path(path))


def plot_entropy(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | os.PathLike) -> Path | None:
    """Mean token entropy over steps (solid) and at high-entropy (forking) tokens (dashed)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for label, records in runs.items():
        dyn = candidate_dynamics(records)
        if "entropy" in dyn:
            line = ax.plot(*dyn["entropy"], label=f"{label}")[0]
            drawn = True
            if "entropy_high_entropy" in dyn:
                ax.plot(
                    *dyn["entropy_high_entropy"],
                    linestyle="--",
                    color=line.get_color(),
                    label=f"{label} (forking tokens)",
                )
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, Path(path))


def plot_entropy_histograms(hists: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path | None:
    """Overlaid per-token entropy histograms (records of ``MetricLogger.log_histogram``), one line per step/label."""
    if not hists:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for h in hists:
        edges, counts = h["edges"], h["counts"]
        total = max(1, sum(counts))
        centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
        label = h.get("label") or f"{h.get('name', 'entropy')} @ step {h.get('step')}"
        ax.plot(centers, [c / total for c in counts], drawstyle="steps-mid", label=label)
    ax.set_xlabel("token entropy (nats)")
    ax.set_ylabel("fraction of tokens")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, Path(path))


def plot_pass_at_k(
    curves: Mapping[str, Mapping[int, float]], path: str | os.PathLike, title: str = "pass@k"
) -> Path | None:
    """pass@k against k (log2 axis) for each labelled model."""
    if not curves:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in curves.items():
        ks = sorted(values)
        ax.plot(ks, [100 * values[k] for k in ks], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, Path(path))


def plot_metric_panels(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], keys: Sequence[str], path: str | os.PathLike, columns: int = 3
) -> Path | None:
    """One panel per metric key (the raw logged values over steps, every run on each), for the keys some run logged;
    None when no run logged any of them."""
    from megatron_rlvr.monitor.dynamics import series

    present = [k for k in keys if any(series(records, (k,))[0] for records in runs.values())]
    if not present:
        return None
    plt = pyplot()
    rows = -(-len(present) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.3 * columns, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        for label, records in runs.items():
            steps, values = series(records, (key,))
            if steps:
                ax.plot(steps, values, marker=".", markersize=3, linewidth=1, label=label)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    return save_figure(fig, Path(path))
