"""pass@k tables (markdown and CSV, benchmarks x k, several models in one table) with their confidence intervals
(`bootstrap.py`), and pass@k curve plots with interval bands."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from megatron_rlvr.eval.band_plot import plot_bands
from megatron_rlvr.eval.bootstrap import IntervalSpec, bootstrap_pass_at_k


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def pass_at_k_rows(
    counts: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]], spec: IntervalSpec = IntervalSpec()
) -> tuple[list[int], list[dict]]:
    """Rows (model, benchmark, problems, n, pass@k per k averaged over problems, its interval per k: Interval) and
    the k columns. Each benchmark's resampling stream is its name: the same problems give the same interval in
    every table, and in `eval compare`."""
    n_all = {int(n.min()) for per_bench in counts.values() for n, _ in per_bench.values()}
    ks = k_values(min(n_all))
    rows = []
    for model, per_bench in counts.items():
        for bench, (n, c) in per_bench.items():
            intervals = bootstrap_pass_at_k(n, c, ks, spec, stream=bench)
            rows.append(
                {
                    "model": model,
                    "benchmark": bench,
                    "problems": len(n),
                    "n": int(n.min()),
                    "pass": {k: iv.estimate for k, iv in intervals.items()},
                    "intervals": intervals,
                }
            )
    rows.sort(key=lambda r: (r["benchmark"], r["model"]))
    return ks, rows


def markdown_table(ks: list[int], rows: list[dict], spec: IntervalSpec = IntervalSpec()) -> str:
    header = (
        "| benchmark | model | problems | n | " + " | ".join(f"pass@{k} [{100 * spec.level:g}%]" for k in ks) + " |"
    )
    lines = [header, "|" + "---|" * (4 + len(ks))]
    for row in rows:
        cells = " | ".join(
            f"{100 * row['pass'][k]:.1f} [{100 * row['intervals'][k].low:.1f}, {100 * row['intervals'][k].high:.1f}]"
            for k in ks
        )
        lines.append(f"| {row['benchmark']} | {row['model']} | {row['problems']} | {row['n']} | {cells} |")
    return "\n".join(lines) + (
        "\n\n(pass@k in percent, unbiased estimator averaged over problems; [low, high]: "
        f"{100 * spec.level:g}% percentile-bootstrap interval over problems, {spec.resamples} resamples, seed "
        f"{spec.seed}; see docs/eval-statistics.md)\n"
    )


def write_reports(
    ks: list[int], rows: list[dict], out_dir: str | Path, spec: IntervalSpec = IntervalSpec()
) -> list[Path]:
    """table.md, table.csv (pass@k, pass@k_low, pass@k_high per k) and one passk_<benchmark>.png per benchmark (the
    curves with their interval bands) under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "table.md", out_dir / "table.csv"]
    written[0].write_text(markdown_table(ks, rows, spec))
    with open(written[1], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["benchmark", "model", "problems", "n"] + [f"pass@{k}{end}" for k in ks for end in ("", "_low", "_high")]
        )
        for row in rows:
            ivs = row["intervals"]
            writer.writerow(
                [row["benchmark"], row["model"], row["problems"], row["n"]]
                + [repr(x) for k in ks for x in (ivs[k].estimate, ivs[k].low, ivs[k].high)]
            )
    for bench in sorted({r["benchmark"] for r in rows}):
        curves = {row["model"]: row["intervals"] for row in rows if row["benchmark"] == bench}
        written.append(
            plot_bands(curves, out_dir / f"passk_{bench.replace('/', '_')}.png", f"{bench}: pass@k", spec.level)
        )
    return written
