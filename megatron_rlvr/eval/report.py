"""pass@k tables (markdown and CSV, benchmarks x k, several models in one table) and pass@k curve plots."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from megatron_rlvr.eval.passk import pass_at_k


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def pass_at_k_rows(counts: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]) -> tuple[list[int], list[dict]]:
    """Rows (model, benchmark, problems, n, pass@k per k averaged over problems) and the k columns."""
    n_all = {int(n.min()) for per_bench in counts.values() for n, _ in per_bench.values()}
    ks = k_values(min(n_all))
    rows = []
    for model, per_bench in counts.items():
        for bench, (n, c) in per_bench.items():
            values = {k: float(np.mean(pass_at_k(n, c, np.full_like(n, k)))) for k in ks}
            rows.append({"model": model, "benchmark": bench, "problems": len(n), "n": int(n.min()), "pass": values})
    rows.sort(key=lambda r: (r["benchmark"], r["model"]))
    return ks, rows


def markdown_table(ks: list[int], rows: list[dict]) -> str:
    header = "| benchmark | model | problems | n | " + " | ".join(f"pass@{k}" for k in ks) + " |"
    lines = [header, "|" + "---|" * (4 + len(ks))]
    for row in rows:
        cells = " | ".join(f"{100 * row['pass'][k]:.1f}" for k in ks)
        lines.append(f"| {row['benchmark']} | {row['model']} | {row['problems']} | {row['n']} | {cells} |")
    return "\n".join(lines) + "\n\n(pass@k in percent, unbiased estimator averaged over problems)\n"


def write_reports(ks: list[int], rows: list[dict], out_dir: str | Path) -> list[Path]:
    """table.md, table.csv and one passk_<benchmark>.png per benchmark under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "table.md", out_dir / "table.csv"]
    written[0].write_text(markdown_table(ks, rows))
    with open(written[1], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["benchmark", "model", "problems", "n"] + [f"pass@{k}" for k in ks])
        for row in rows:
            writer.writerow([row["benchmark"], row["model"], row["problems"], row["n"]] + [repr(row["pass"][k]) for k in ks])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for bench in sorted({r["benchmark"] for r in rows}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for row in (r for r in rows if r["benchmark"] == bench):
            ax.plot(ks, [100 * row["pass"][k] for k in ks], marker="o", label=row["model"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k (%)")
        ax.set_title(f"{bench}: pass@k")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = out_dir / f"passk_{bench.replace('/', '_')}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
