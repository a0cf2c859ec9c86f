"""Print the memory plan of every training recipe as two markdown tables: GPU memory per phase and host memory per
node. What docs/plan.md's "The recipes' plans" section shows, regenerated from `megatron-rlvr plan --json`.

    .venv/bin/python tools/reports/plan_tables.py            # every training recipe in configs/
    .venv/bin/python tools/reports/plan_tables.py RECIPE...  # just these

Exit status 3 when a recipe does not fit (its row says which component breaks it), 2 for a recipe plan refuses.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOST_PARTS = ("staging", "sleep_offload", "transfer_buckets", "reward_pool", "data_loader", "process", "launcher")


def training_recipes() -> list[str]:
    """Recipes with a GPU layout: not the CPU demos and tests, not the eval-only configs."""
    names = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    return [n for n in names if not n.startswith("eval_") and "cpu" not in n]


def plan(recipe: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.cli", "plan", recipe, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if out.returncode not in (0, 3):
        raise SystemExit(f"plan {recipe}: exit {out.returncode}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout)


def layout_text(layout: dict) -> str:
    parts = [f"TP{layout['tp']}", f"PP{layout['pp']}"]
    parts += [f"{key.upper()}{layout[key]}" for key in ("cp", "ep", "etp") if layout.get(key, 1) > 1]
    parts.append(f"DP{layout['dp']}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", help="recipe names (default: every training recipe)")
    args = parser.parse_args(argv)
    plans = [plan(r) for r in args.recipes or training_recipes()]
    print(
        "| recipe | nodes | actor layout | tokens per micro-batch (per CP rank) | rollout | statistics | update "
        "| sync | peak GB of GPU | fits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in plans:
        lay, ph = p["layout"], p["phases"]
        fits = "yes" if p["gpu_fits"] else f"no: {p['breaking_component']}"
        print(
            f"| {p['recipe']} | {p['nodes']} | {layout_text(lay)} | {lay['micro_tokens']} | {ph['rollout']:.1f} | "
            f"{ph['statistics']:.1f} | {ph['update']:.1f} | {ph['sync']:.1f} | {p['peak_gb']:.1f} of "
            f"{p['gpu_memory_gb']:.0f} | {fits} |"
        )
    print()
    print(f"| recipe | engine TP | {' | '.join(HOST_PARTS)} | total GB per node | fits |")
    print("|---|---|" + "---|" * len(HOST_PARTS) + "---|---|")
    for p in plans:
        host = p["host"]
        parts = " | ".join(f"{host['components'][f'{k}_gb']:.1f}" for k in HOST_PARTS)
        fits = "yes" if host["fits"] else f"no: {host['breaking_component']}"
        print(
            f"| {p['recipe']} | {p['layout']['engine_tp']} | {parts} | {host['total_gb']:.1f} of "
            f"{host['host_memory_gb']:.0f} | {fits} |"
        )
    return 0 if all(p["fits"] for p in plans) else 3


if __name__ == "__main__":
    raise SystemExit(main())
