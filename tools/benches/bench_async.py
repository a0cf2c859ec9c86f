"""Benchmark: on-policy, one-step-off and fully asynchronous training side by side, the engine on a rank of its own.

One run of this tool trains the demo recipe once per mode on 2 processes (torchrun): actor TP=1 on rank 0, one CPU
vLLM engine on rank 1 (``rollout.placement=separate rollout.engine_ranks=1``; each rank pinned to its own core), with
``rollout.max_staleness`` 0 (on-policy: the engine waits for each update, the actor for each generation), 1
(one-step-off: the engine samples step t+1 while the actor runs update t) and each ``--async-k`` (fully
asynchronous: the engine streams within the bound, docs/async.md). Decoupled PPO (``algo.rollout_correction.kind=tis``)
in every mode; one mini-batch without the KL term (no statistics or reference pass).

The workload has long-tailed answer lengths, as reasoning responses have: the demo model would end most answers
after ~8 tokens, so megatron_rlvr/testing/long_tail makes every answer to a prompt exactly L tokens, L log-normal
per prompt (``--median``, ``--sigma``), cut at ``--max-new-tokens``. The same prompt gets the same L in every mode;
the lengths of the measured steps' prompts are reported (median, longest).

Each mode runs once per engine cost shape (``--engine-step-ms``, default 0 and 10). At 0 the engine costs what the
CPU makes it cost: a step of the tiny demo model costs in proportion to its batch, so a step's long tail (a few
sequences decoding alone) is cheap. On a GPU a decode step of a large model is bound by reading the weights and costs
nearly the same for 1 sequence as for 256: there the tail costs as much per token position as the full batch, which
is what fully asynchronous training wins back. The hook adds that fixed cost to every engine step of every mode
(vLLM's ``LLMEngine.step``, which on-policy and one-step-off reach through ``LLM.generate`` and the stream calls
directly); the JSON's top-level figures are those of the last cost listed, each cost's ratios are under
``by_engine_step_ms``.

Per mode, over the steps after ``--warmup`` (the first ones include the engine start): samples/s (trained responses
over the trainer's wall time: the sum of its per-step breakdown, rollout wait + statistics + update + weight sync),
the trainer's idle share (its rollout wait over that time), the engine's idle share (1 - the engine's busy time,
``rollout/engine_seconds``, over that time), the mean staleness of the trained responses and, for the streamed
modes, the prefix cache's hits (``rollout/prefix_cache_hits`` over ``rollout/prefix_cache_queries``: the share of
the started responses' prompt tokens served from cached KV blocks). The last line is one JSON object.

The demo's prompts are 12 tokens, less than a KV block, so nothing is ever shared through the prefix cache.
``--shared-head TOKENS`` puts the same head of at least TOKENS tokens (a system prompt, a shared problem statement)
before every prompt: the demo task's training problems, written as a JSONL data file in the output directory. With
``rollout.kv_block_size=32`` among the overrides its first block is shared; what the prefix cache's weight salt
(rollout/prefix_cache.py) costs shows there: a prompt admitted after an update cannot reuse the head the older weights
computed.

    python tools/benches/bench_async.py      # 12 steps per mode (4 warm-up), median 8 tokens, sigma 1.2, +0 and +10 ms
    python tools/benches/bench_async.py --steps 6 --warmup 2 --async-k 2 --engine-step-ms 0
    python tools/benches/bench_async.py --steps 8 --warmup 2 --async-k 2 --engine-step-ms 0 --shared-head 32 \
        --max-new-tokens 80 rollout.kv_block_size=32
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "megatron_rlvr" / "testing" / "long_tail"
_STEP_PARTS = ("time/rollout+reward", "time/statistics", "time/update", "time/sync", "time/eval")


def _train(out: Path, k: int, args: argparse.Namespace, recompute: bool = False) -> list[dict]:
    overrides = [
        f"rollout.recompute_kv_after_sync={str(recompute).lower()}",
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
        f"rollout.max_staleness={k}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"eval.max_new_tokens={args.max_new_tokens}",
        f"trainer.prompts_per_step={args.prompts}",
        "algo.rollout_correction.kind=tis",
        "algo.kl.coef=0",
        "trainer.mini_batches_per_step=1",
        *args.overrides,
    ]
    from megatron_rlvr.testing.demo_command import demo_train_command

    cmd = demo_train_command(overrides)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HOOK), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "MEGATRON_RLVR_LONG_TAIL": f"{args.median},{args.sigma},{args.step_ms / 1000}",
    }
    log = out.with_suffix(".log")
    started = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, env=env)
    if done.returncode != 0:
        sys.exit(f"max_staleness={k}: training exited {done.returncode}; see {log}")
    print(
        f"max_staleness={k}: {args.steps} steps in {time.perf_counter() - started:.1f} s (engine start included); "
        f"log {log}",
        flush=True,
    )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _shared_head_data(out: Path, tokens: int) -> list[str]:
    """The demo task's training problems behind one shared head of >= ``tokens`` tokens, as a JSONL file in ``out``;
    returns the overrides that train on it."""
    from transformers import AutoTokenizer

    from megatron_rlvr.config import load_config
    from megatron_rlvr.tasks import countdown

    data = load_config(ROOT / "configs" / "demo_cpu.yaml").data
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "megatron_rlvr" / "demo" / "model")
    head = ""
    while len(tokenizer(head, add_special_tokens=False)["input_ids"]) < tokens:
        head += f"{len(head) % 10} "  # digits and spaces: text the demo model's 37-token vocabulary holds
    head += "\n"
    path = out / "shared_head.jsonl"
    with open(path, "w") as f:
        for p in countdown.generate(data.seed, data.demo_train_problems, "train"):
            f.write(json.dumps({"id": p.id, "problem": head + p.prompt, "answer": p.reference}) + "\n")
    length = len(tokenizer(head, add_special_tokens=False)["input_ids"])
    print(f"shared head: {length} tokens before every prompt ({path})", flush=True)
    # the demo's prompts are 12 tokens; the head plus 16 leaves the answer budget its room in 128 positions
    return [f"data.path={path}", "data.task=countdown", f"data.max_prompt_tokens={length + 15}"]


def _step_s(row: dict) -> float:
    return sum(row.get(k, 0.0) for k in _STEP_PARTS)


def summarize(rows: list[dict], responses_per_step: int) -> dict:
    """One mode's figures over its measured steps (see the module doc)."""
    wall = sum(_step_s(r) for r in rows)
    return {
        "samples_per_s": len(rows) * responses_per_step / wall,
        "step_s": statistics.median(_step_s(r) for r in rows),
        "trainer_idle": sum(r["time/rollout+reward"] for r in rows) / wall,
        "engine_idle": max(0.0, 1.0 - sum(r["rollout/engine_seconds"] for r in rows) / wall),
        "mean_staleness": statistics.fmean(r["rollout/staleness"] for r in rows),
        "max_staleness": max(r.get("rollout/staleness_max", r["rollout/staleness"]) for r in rows),
        "mixed_version_frac": statistics.fmean(r.get("rollout/mixed_version_frac", 0.0) for r in rows),
        # streamed modes only (the stream counts them): prompt tokens of started responses, and those cached
        "prefix_cache_queries": sum(r.get("rollout/prefix_cache_queries", 0.0) for r in rows),
        "prefix_cache_hits": sum(r.get("rollout/prefix_cache_hits", 0.0) for r in rows),
        "dropped": sum(r.get("async/dropped", 0.0) for r in rows),
        "response_length": statistics.fmean(r["response/length"] for r in rows),
    }


def workload_lengths(args: argparse.Namespace, steps: range) -> list[int]:
    """The answer lengths the long-tail hook gives the prompts of ``steps`` (those the step path samples; the stream
    admits the same prompts in the same order, with the same seeds)."""
    from megatron_rlvr.config import load_config
    from megatron_rlvr.experience.collect import sampling_seed
    from megatron_rlvr.rollout.base import prompt_seed

    spec = importlib.util.spec_from_file_location("long_tail_hook", HOOK / "sitecustomize.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)  # type: ignore[union-attr]
    seed = load_config(ROOT / "configs" / "demo_cpu.yaml").trainer.seed
    return [
        hook.length(prompt_seed(sampling_seed(seed, s, 0, 0), i), args.max_new_tokens, args.median, args.sigma)
        for s in steps
        for i in range(args.prompts)
    ]


def _figures(modes: dict[int, dict], recomputed: dict[int, dict]) -> dict:
    """One workload's modes and ratios (the JSON's shape for it)."""
    names = {0: "on_policy", 1: "one_step_off"}
    result: dict = {names.get(k, f"async_k{k}"): {n: round(v, 4) for n, v in m.items()} for k, m in modes.items()}
    base = modes[1]["samples_per_s"]
    for k in [k for k in modes if k >= 2]:
        result[f"async_k{k}_over_one_step_off"] = round(modes[k]["samples_per_s"] / base, 3)
    for k, m in recomputed.items():
        result[f"async_k{k}_recompute"] = {n: round(v, 4) for n, v in m.items()}
        result[f"async_k{k}_recompute_over_keep"] = round(m["samples_per_s"] / modes[k]["samples_per_s"], 3)
    result["one_step_off_over_on_policy"] = round(base / modes[0]["samples_per_s"], 3)
    streamed = [m for k, m in modes.items() if k >= 2] + list(recomputed.values())
    result["max_staleness_seen"] = max((m["max_staleness"] for m in streamed), default=None)
    result["dropped"] = sum(m["dropped"] for m in [*modes.values(), *recomputed.values()])
    return result


def _table(step_ms: float, modes: dict[int, dict], recomputed: dict[int, dict]) -> str:
    label = {0: "on-policy (k = 0)", 1: "one-step-off (k = 1)"}
    rows = [(label.get(k, f"fully async, k = {k}"), m) for k, m in modes.items()]
    rows += [(f"fully async, k = {k}, KV recomputed at each sync", m) for k, m in recomputed.items()]
    lines = [
        f"engine step + {step_ms:g} ms:",
        "| mode | samples/s | s/step | trainer idle | engine idle | mean staleness | responses of two versions "
        "| dropped | prefix-cache hits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in rows:
        queries = m["prefix_cache_queries"]
        hits = f"{m['prefix_cache_hits']:g} of {queries:g} ({m['prefix_cache_hits'] / queries:.1%})" if queries else "-"
        lines.append(
            f"| {name} | {m['samples_per_s']:.1f} | {m['step_s']:.2f} "
            f"| {m['trainer_idle']:.0%} | {m['engine_idle']:.0%} | {m['mean_staleness']:.2f} "
            f"| {m['mixed_version_frac']:.1%} | {m['dropped']:g} | {hits} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the figures")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="answer budget (prompt <= 32 of 128 tokens)")
    parser.add_argument("--median", type=float, default=8.0, help="median answer length (tokens)")
    parser.add_argument("--sigma", type=float, default=1.2, help="log-space spread of the answer lengths")
    parser.add_argument(
        "--engine-step-ms",
        default="0,10",
        help="comma-separated: milliseconds added to every engine step whatever its batch, one workload each (0: the "
        "CPU's own cost shape; > 0: a GPU decode step's); the JSON's top-level figures are the last one's",
    )
    parser.add_argument("--prompts", type=int, default=16, help="trainer.prompts_per_step")
    parser.add_argument("--async-k", default="2,4", help="the fully asynchronous modes' max_staleness values")
    parser.add_argument(
        "--recompute-k",
        default="",
        help="fully asynchronous modes to run once more with rollout.recompute_kv_after_sync=true (its cost)",
    )
    parser.add_argument(
        "--shared-head",
        type=int,
        default=0,
        help="every prompt starts with the same head of at least this many tokens (0: the demo's prompts)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per training run")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_async_"))
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    if args.shared_head:
        args.overrides = [*_shared_head_data(out, args.shared_head), *args.overrides]
    ks = [0, 1, *(int(k) for k in args.async_k.split(",") if k)]
    group = 8  # the demo recipe's rollout.group_size
    by_cost: dict[str, dict] = {}
    for step_ms in [float(ms) for ms in args.engine_step_ms.split(",") if ms]:
        args.step_ms = step_ms
        where = out / f"step{step_ms:g}ms"
        where.mkdir(parents=True, exist_ok=True)
        modes, recomputed = {}, {}
        for k in ks:
            rows = _train(where / f"k{k}", k, args)[args.warmup :]
            modes[k] = summarize(rows, args.prompts * group)
            print(f"max_staleness={k}: " + ", ".join(f"step {r['step']} {_step_s(r):.2f} s" for r in rows), flush=True)
        for k in (int(k) for k in args.recompute_k.split(",") if k):
            rows = _train(where / f"k{k}_recompute", k, args, recompute=True)[args.warmup :]
            recomputed[k] = summarize(rows, args.prompts * group)
        print(_table(step_ms, modes, recomputed), flush=True)
        by_cost[f"{step_ms:g}"] = _figures(modes, recomputed)
    lengths = sorted(workload_lengths(args, range(args.warmup, args.steps)))
    result = {**by_cost[f"{args.step_ms:g}"], "engine_step_ms": args.step_ms}
    result["by_engine_step_ms"] = {ms: {k: v for k, v in f.items() if "over" in k} for ms, f in by_cost.items()}
    result["max_staleness_seen"] = max((f["max_staleness_seen"] or 0) for f in by_cost.values())
    result["dropped"] = sum(f["dropped"] for f in by_cost.values())
    result["lengths"] = {
        "median": statistics.median(lengths),
        "longest": max(lengths),
        "mean": round(statistics.fmean(lengths), 2),
        "distribution": f"per prompt, log-normal: median {args.median:g}, sigma {args.sigma:g}, cut at "
        f"{args.max_new_tokens}",
    }
    result["loadavg_before_after"] = [round(load_before[0], 1), round(os.getloadavg()[0], 1)]
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
