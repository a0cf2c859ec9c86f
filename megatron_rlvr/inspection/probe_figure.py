"""The probe's figure: each statistic's mean over the probe set per checkpoint, in the order given, with its 95%
bootstrap interval over prompts; all positions and the base's forking positions side by side."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_rlvr.inspection.mechanism_stats import prompt_interval, rare_logp, statistic

PANELS = (
    ("rank1", "rank-1 probability"),
    ("top3", "top-3 mass"),
    ("gap", "rank-1 minus rank-2"),
    ("entropy", "entropy (nats)"),
    ("rank3_below", "share with rank-3 < 0.05"),
)


def render(scores: Sequence[dict[str, Any]], path: str | os.PathLike, resamples: int = 400) -> Path:
    from megatron_rlvr.eval.bootstrap import IntervalSpec
    from megatron_rlvr.monitor.plots import pyplot

    plt = pyplot()
    spec = IntervalSpec(resamples=resamples)
    ks = scores[0]["settings"]["ks"]
    panels = [*PANELS, *((f"distinct@{k}", f"E[distinct tokens in {k} draws]") for k in ks)]
    has_rare = all(s["rare"] for s in scores)
    cols = math.ceil((len(panels) + has_rare) / 2)
    fig, grid = plt.subplots(2, cols, figsize=(3.2 * cols, 6.4), squeeze=False)
    axes = [list(grid.flat)]
    for ax in axes[0][len(panels) + has_rare :]:
        ax.axis("off")
    x = list(range(len(scores)))
    labels = [s["label"] for s in scores]
    prompts = len(scores[0]["prompts"])
    for ax, (name, title) in zip(axes[0], panels):
        for scope, style in (("all", "-o"), ("forking", "--s")):
            ivs = [prompt_interval(statistic(s, scope, name), prompts, spec, f"{name}/{scope}") for s in scores]
            ax.plot(x, [iv.estimate for iv in ivs], style, label=scope, markersize=3)
            ax.fill_between(x, [iv.low for iv in ivs], [iv.high for iv in ivs], alpha=0.2)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=7)
    if has_rare:
        ax = axes[0][len(panels)]
        ivs = [prompt_interval(rare_logp(s, per_token=True), prompts, spec, "rare") for s in scores]
        ax.plot(x, [iv.estimate for iv in ivs], "-o", color="C3", markersize=3)
        ax.fill_between(x, [iv.low for iv in ivs], [iv.high for iv in ivs], alpha=0.2, color="C3")
        ax.set_title("rare correct: log-prob / token", fontsize=9)
        ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
