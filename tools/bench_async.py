"""Benchmark: one-step-off training against on-policy training, both with the engine on a rank of its own.

One run of this tool trains the demo recipe twice on 2 processes (torchrun): actor TP=1 on rank 0, one CPU vLLM
engine on rank 1 (``rollout.placement=separate rollout.engine_ranks=1``; each rank pinned to its own core), first
with ``trainer.off_policy_steps=0`` (the engine waits for each update, the actor for each generation), then with 1
(the engine samples step t+1 while the actor runs update t). The ideal speedup is 2 when generation and the update
take the same time; the answer length sets that balance. Every answer is exactly ``--max-new-tokens`` long
(``rollout.min_new_tokens`` = max: the demo model would end most answers with EOS after ~8 tokens), and the update is
one mini-batch without the KL term (no statistics or reference pass). ``gen_s`` and ``update_s`` show the balance.

A step's time is the trainer's own per-step breakdown summed (rollout wait, statistics, update, weight sync; logging
and the first steps, which include the engine start, are left out); each figure is the median over the measured
steps. ``transfer_s`` is the weight transfer's median (rollout/transfer.py), ``gen_s`` the engine's time per step
(generation, scoring) and ``update_s`` the actor's (statistics + update) in the on-policy run. The last line is one
JSON object.

    python tools/bench_async.py                      # 10 steps each (3 warm-up), 96-token answers
    python tools/bench_async.py --steps 6 --warmup 2 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_STEP_PARTS = ("time/rollout+reward", "time/statistics", "time/update", "time/sync", "time/eval")


def _train(out: Path, off_policy: int, args: argparse.Namespace) -> list[dict]:
    overrides = [
        f"trainer.steps={args.steps}",
        f"trainer.output_dir={out}",
        "trainer.eval_every=0",
        "trainer.save_hf=false",
        "trainer.tensorboard=false",
        "checkpoint.save_every=0",
        "checkpoint.resume=null",
        "rollout.placement=separate",
        "rollout.engine_ranks=1",
        "actor.tp=1",
        f"trainer.off_policy_steps={off_policy}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.min_new_tokens={args.max_new_tokens}",
        "rollout.stop=[]",
        f"eval.max_new_tokens={args.max_new_tokens}",
        f"trainer.prompts_per_step={args.prompts}",
        "algo.rollout_correction=tis",
        "algo.kl_coef=0",
        "trainer.mini_batches_per_step=1",
        *args.overrides,
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "megatron_rlvr.cli",
        "train",
        str(ROOT / "configs" / "demo_cpu.yaml"),
        *overrides,
    ]
    log = out.with_suffix(".log")
    started = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=args.timeout,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    if done.returncode != 0:
        sys.exit(f"off_policy_steps={off_policy}: training exited {done.returncode}; see {log}")
    print(
        f"off_policy_steps={off_policy}: {args.steps} steps in {time.perf_counter() - started:.1f} s "
        f"(engine start included); log {log}",
        flush=True,
    )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _median(rows: list[dict], key) -> float:
    return statistics.median(key(r) for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="answer budget (prompt <= 32 of 128 tokens)")
    parser.add_argument("--prompts", type=int, default=16, help="trainer.prompts_per_step")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per training run")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for both runs")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_async_"))
    out.mkdir(parents=True, exist_ok=True)
    runs = {off: _train(out / f"off{off}", off, args)[args.warmup :] for off in (0, 1)}

    def step_s(row: dict) -> float:
        return sum(row.get(k, 0.0) for k in _STEP_PARTS)

    sync_rows, async_rows = runs[0], runs[1]
    result = {
        "sync_step_s": _median(sync_rows, step_s),
        "async_step_s": _median(async_rows, step_s),
        "transfer_s": _median(sync_rows + async_rows, lambda r: r.get("transfer/seconds", 0.0)),
        "transfer_bytes": _median(sync_rows, lambda r: r.get("transfer/bytes", 0.0)),
        "gen_s": _median(sync_rows, lambda r: r["rollout/engine_seconds"]),
        "update_s": _median(sync_rows, lambda r: r["time/statistics"] + r["time/update"]),
        "async_wait_s": _median(async_rows, lambda r: r["time/rollout+reward"]),
        "async_staleness": _median(async_rows, lambda r: r["rollout/staleness"]),
        "response_length": _median(sync_rows, lambda r: r["response/length"]),
        "steps_measured": len(sync_rows),
    }
    result["async_speedup"] = result["sync_step_s"] / result["async_step_s"]
    for off, rows in runs.items():
        print(f"off_policy_steps={off}: " + ", ".join(f"step {r['step']} {step_s(r):.2f} s" for r in rows), flush=True)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
