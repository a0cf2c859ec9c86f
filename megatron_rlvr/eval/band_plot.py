"""PNG of pass@k curves with their confidence bands on a log-k axis, optionally over a panel of a paired difference.

`plot_bands` takes plain data: label -> {k: Interval} (fractions; plotted in percent), and for the lower panel one
{k: Interval} of a difference (B - A). Matplotlib runs on the Agg backend: files only, never a display.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from megatron_rlvr.eval.bootstrap import Interval


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _band(ax, ks: list[int], intervals: Mapping[int, Interval], label: str, **style) -> None:
    est = [100 * intervals[k].estimate for k in ks]
    low = [100 * intervals[k].low for k in ks]
    high = [100 * intervals[k].high for k in ks]
    (line,) = ax.plot(ks, est, marker="o", markersize=3, label=label, **style)
    ax.fill_between(ks, low, high, color=line.get_color(), alpha=0.2, linewidth=0)


def plot_bands(
    curves: Mapping[str, Mapping[int, Interval]],
    path: str | os.PathLike,
    title: str,
    level: float,
    difference: Mapping[int, Interval] | None = None,
    difference_label: str = "B - A",
) -> Path:
    """Write the figure to ``path`` and return it."""
    plt = _pyplot()
    rows = 2 if difference else 1
    fig, axes = plt.subplots(
        rows,
        1,
        figsize=(6.4, 4.2 * rows if rows == 1 else 7.0),
        squeeze=False,
        sharex=True,
        gridspec_kw={"height_ratios": [2, 1]} if rows == 2 else None,
    )
    top = axes[0][0]
    for label, intervals in curves.items():
        _band(top, sorted(intervals), intervals, label)
    top.set_xscale("log", base=2)
    top.set_ylabel("pass@k (%)")
    top.set_title(f"{title} (bands: {100 * level:g}% intervals)")
    top.grid(True, alpha=0.3)
    top.legend()
    if difference:
        bottom = axes[1][0]
        _band(bottom, sorted(difference), difference, f"{difference_label} (paired)", color="black")
        bottom.axhline(0.0, color="gray", linewidth=0.8)
        bottom.set_xscale("log", base=2)
        bottom.set_ylabel("difference (points)")
        bottom.grid(True, alpha=0.3)
        bottom.legend()
    axes[-1][0].set_xlabel("k")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
