"""On-policy distillation on the CPU demo: four `megatron-rlvr demo` runs from the weak demo model, one table.

    python tools/reports/distill_demo.py [--out outputs/distill_demo] [--rows rl distill rl+distill self] [--steps 100]
    python tools/reports/distill_demo.py --table-only --out outputs/distill_demo      (the table of the finished rows)

Student = megatron_rlvr/demo/weak_model (it is copied in as each run's base_model, so the demo trains it and its
evaluation compares against it); teacher = megatron_rlvr/demo/model (trained on the task). Rows, all on the demo
recipe (configs/demo_cpu.yaml: CaSP, its KL anchor to the student's initial weights):
- rl: RL alone;
- distill: distillation alone (algo.distill.kind=teacher, algo.distill.only: no advantage term);
- rl+distill: RL + distillation (algo.distill.kind=teacher, algo.distill.coef=1);
- self: self-distillation alone, the teacher being the frozen student reading a solution before the prompt
  (algo.distill.kind=self, algo.distill.template="{answer}\\n", algo.distill.only).
Each row's log: <out>/<row>.log. The table (pass@k of the base and each trained row, prompts solved at least once
gained / lost against the base, the last-10-steps mean of the distill metrics) goes to <out>/table.md, the distill
metrics' curves to <out>/distill_metrics.png; the script ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STUDENT = REPO / "megatron_rlvr" / "demo" / "weak_model"
TEACHER = REPO / "megatron_rlvr" / "demo" / "model"
ROWS: dict[str, list[str]] = {
    "rl": [],
    "distill": ["algo.distill.kind=teacher", f"algo.distill.teacher_hf_dir={TEACHER}", "algo.distill.only=true"],
    "rl+distill": ["algo.distill.kind=teacher", f"algo.distill.teacher_hf_dir={TEACHER}", "algo.distill.coef=1.0"],
    "self": ["algo.distill.kind=self", 'algo.distill.template="{answer}\\n"', "algo.distill.only=true"],
}
DISTILL_KEYS = ("distill/reverse_kl", "distill/forward_kl_topn", "distill/teacher_logp", "distill/top1_agreement")


def run_row(out: Path, name: str, steps: int) -> int:
    row = out / name.replace("+", "_")
    (row / "base_model").parent.mkdir(parents=True, exist_ok=True)
    if not (row / "base_model" / "config.json").is_file():  # the demo keeps a base_model it finds: the student
        shutil.copytree(STUDENT, row / "base_model", dirs_exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "megatron_rlvr.cli",
        "demo",
        "--out",
        str(row),
        "--algo",
        "casp",
        f"trainer.steps={steps}",
        *ROWS[name],
    ]
    with open(out / f"{row.name}.log", "a") as log:
        log.write("+ " + " ".join(cmd) + "\n")
        log.flush()
        return subprocess.run(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1")
        ).returncode


def _last_mean(records: list[dict], key: str, last: int = 10) -> float | None:
    values = [r[key] for r in records if key in r][-last:]
    return sum(values) / len(values) if values else None


def table(out: Path) -> dict:
    from megatron_rlvr.monitor.plots import plot_metric_panels
    from megatron_rlvr.monitor.sinks import read_metrics

    rows, runs, base = {}, {}, None
    for name in ROWS:
        row = out / name.replace("+", "_")
        results = row / "report" / "results.json"
        if not results.is_file():
            rows[name] = None
            continue
        data = json.loads(results.read_text())
        (base_label, trained_label) = list(data["models"])[:2]
        solved = {label: {p for p, s in per.items() if s["correct"]} for label, per in data["per_prompt"].items()}
        records = read_metrics(row / "train" / "metrics.jsonl")
        runs[name] = records
        base = base or {
            "pass_at_k": data["models"][base_label]["pass_at_k"],
            "solved": len(solved[base_label]),
            "prompts": data["models"][base_label]["prompts"],
        }
        rows[name] = {
            "pass_at_k": data["models"][trained_label]["pass_at_k"],
            "solved": len(solved[trained_label]),
            "gained": len(solved[trained_label] - solved[base_label]),
            "lost": len(solved[base_label] - solved[trained_label]),
            "distill": {k: _last_mean(records, k) for k in DISTILL_KEYS},
            "train_reward_last10": _last_mean(records, "reward/mean"),
        }
    ks = sorted({int(k) for r in rows.values() if r for k in r["pass_at_k"]})
    lines = [
        "| run | " + " | ".join(f"pass@{k}" for k in ks) + " | solved | gained | lost | reverse_kl | "
        "forward_kl_topn | teacher_logp | top1_agreement |",
        "|---|" + "---|" * (len(ks) + 7),
    ]

    def cells(curve: dict) -> str:
        return " | ".join(f"{100 * curve[str(k)]:.1f}" for k in ks)

    if base:
        lines.append(
            f"| student (weak model, base) | {cells(base['pass_at_k'])} | {base['solved']} | - | - | - | - | - | - |"
        )
    for name, r in rows.items():
        if r is None:
            lines.append(f"| {name} | not run |")
            continue
        d = " | ".join("-" if v is None else f"{v:.3f}" for v in r["distill"].values())
        lines.append(f"| {name} | {cells(r['pass_at_k'])} | {r['solved']} | {r['gained']} | {r['lost']} | {d} |")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    print(text)
    if runs:
        plot_metric_panels(runs, (*DISTILL_KEYS, "reward/mean"), out / "distill_metrics.png", columns=3)
    return {"base": base, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/distill_demo")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    codes = {}
    if not args.table_only:
        for name in args.rows:
            codes[name] = run_row(out, name, args.steps)
            print(f"[distill_demo] {name}: exit {codes[name]}", flush=True)
    summary = table(out)
    print(json.dumps({"exit_codes": codes, **summary}))
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
