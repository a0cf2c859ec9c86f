"""Benchmark: the actor's update and statistics pass at context parallelism CP = 1 against CP = 2, on long sequences.

One run, one small random Qwen2 on 2 gloo processes, the same weights and the same rollouts for both layouts:
  cp1   CP = 1, DP = 2: each rank runs whole sequences (one per micro-batch)
  cp2   CP = 2, DP = 1: each rank runs its half of every sequence (chunks r and 3 - r of 4), the same micro-batches
Every sequence is at least 4k tokens. Reported per layout: the peak bytes a pass allocates per rank (counted by a
dispatch mode in a separate, untimed call: the activations, logits, attention scores and every transient), and the
median time of the update (actor.update, one mini-batch, lr = 0 so every repeat starts from the same weights) and
of the statistics pass (compute_old_logp) after a warm-up. grad_max_rel_diff compares the two updates' full
gradients: max |cp2 - cp1| / max |cp1|. The last line is one JSON object.

    python tools/benches/bench_context_parallel.py            # 4 sequences of 4096..6144 tokens, 2 layers
    python tools/benches/bench_context_parallel.py --quick    # 2 sequences of 4096 and 4099 tokens, 2 layers, 1 repeat
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_rlvr.testing.configs import algo_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_rlvr.testing.workers import LiveBytes  # noqa: E402 (after the path insert)


@dataclasses.dataclass
class BenchConfig:
    lengths: tuple[int, ...] = (6144, 4099, 5001, 4096)
    prompt_len: int = 64
    repeats: int = 2
    model: dict = dataclasses.field(
        default_factory=lambda: dict(num_hidden_layers=2, max_position_embeddings=6144, vocab_size=4096)
    )
    seed: int = 0


QUICK = dict(lengths=(4096, 4099), repeats=1)


def make_batch(lengths: tuple[int, ...], vocab: int, prompt_len: int, seed: int):
    """(rollouts of ``lengths`` tokens with responses after ``prompt_len``, their targets: random advantages)."""
    from megatron_rlvr.protocols import Targets
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    tokens = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        tokens[i, n:] = 0
        mask[i, prompt_len - 1 : n - 1] = True
    return rollouts(tokens, mask), Targets(advantages=torch.randn(len(lengths), generator=g))


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    import torch.distributed as dist

    times = []
    for i in range(repeats + 1):  # the first call warms up
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_bytes(fn: Callable[[], Any]) -> int:
    with LiveBytes() as tracker:
        fn()
    return tracker.peak


def _worker(hf_dir: str, cfg: BenchConfig) -> dict[str, Any]:
    import torch.distributed as dist

    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.runtime.distributed import model_parallel

    results: dict[str, Any] = {}
    for name, cp in (("cp1", 1), ("cp2", 2)):
        with model_parallel(tp=1, pp=1, cp=cp, seed=1):
            # one sequence per micro-batch at both layouts (a budget below every length, counted per CP rank)
            actor = MegatronActor(
                ModelConfig(hf_dir=hf_dir),
                ActorConfig(cp=cp, lr=0.0, max_tokens_per_micro_batch=1, use_distributed_optimizer=False),
                algo_config({"loss.kind": "casp", "loss.agg": "token_mean"}),
                temperature=1.0,
                total_steps=1,
            )
            batch, targets = make_batch(cfg.lengths, actor.vocab_size, cfg.prompt_len, cfg.seed)
            _, micro = actor.passes.plan(batch)
            statistics = actor.statistics_pass(batch)
            stats_s = _median_seconds(lambda: actor.compute_old_logp(batch), cfg.repeats)
            update_s = _median_seconds(lambda: actor.update(batch, targets, statistics, mini_batches=1), cfg.repeats)
            stats_bytes = _peak_bytes(lambda: actor.compute_old_logp(batch))
            update_bytes = _peak_bytes(lambda: actor.update(batch, targets, statistics, mini_batches=1))
            peaks = torch.tensor([stats_bytes, update_bytes], dtype=torch.float64)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the worst rank
            results[name] = dict(
                micro_batches_per_rank=len(micro),
                tokens_per_rank_per_micro_batch=max(m.packed.num_tokens for m in micro),
                stats_s=stats_s,
                update_s=update_s,
                stats_peak_bytes=int(peaks[0]),
                update_peak_bytes=int(peaks[1]),
                grads=torch.cat([p.main_grad.reshape(-1).clone() for c in actor.model for p in c.module.parameters()]),
                cp_padding=actor.passes.last_cp_padding,
            )
            actor = None  # free the layout's model before the next is built
    a, b = results["cp1"]["grads"], results["cp2"]["grads"]
    results["grad_max_rel_diff"] = float((b - a).abs().max() / a.abs().max())
    for name in ("cp1", "cp2"):
        del results[name]["grads"]
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two 4k-token sequences, one repeat (under 3 minutes)")
    parser.add_argument("--lengths", type=int, nargs="+", help="the sequences' lengths (each >= 4096 for the goal)")
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args(argv)
    cfg = BenchConfig(**QUICK) if args.quick else BenchConfig()
    if args.lengths:
        cfg.lengths = tuple(args.lengths)
    if args.repeats is not None:
        cfg.repeats = args.repeats
    if len(cfg.lengths) % 2:
        parser.error("--lengths: an even count (CP = 1 runs them over DP = 2)")

    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model
    from megatron_rlvr.testing.workers import WorkerGroup

    cfg.model["max_position_embeddings"] = max(cfg.model["max_position_embeddings"], max(cfg.lengths))
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(make_tiny_hf_model("qwen2", Path(tmp) / "model", seed=cfg.seed, **cfg.model))
        with WorkerGroup(2, timeout_s=1800) as group:
            result = group.run(_worker, hf_dir, cfg)[0]
    one, two = result["cp1"], result["cp2"]
    print(
        f"workload: {len(cfg.lengths)} sequences of {list(cfg.lengths)} tokens, the tiny Qwen2 with "
        f"{cfg.model['num_hidden_layers']} layers (4 heads of 32, 2 KV groups, width 128), vocab "
        f"{cfg.model['vocab_size']}; 2 gloo processes; one sequence per micro-batch"
    )
    print(
        f"{'layout':10} {'tokens/rank':>11} {'stats s':>8} {'update s':>9} {'stats peak MiB':>14} {'update peak MiB':>15}"
    )
    for label, r in (("CP=1 DP=2", one), ("CP=2 DP=1", two)):
        print(
            f"{label:10} {r['tokens_per_rank_per_micro_batch']:11d} {r['stats_s']:8.2f} {r['update_s']:9.2f} "
            f"{r['stats_peak_bytes'] / 2**20:14.1f} {r['update_peak_bytes'] / 2**20:15.1f}"
        )
    summary = {
        "lengths": list(cfg.lengths),
        "layers": cfg.model["num_hidden_layers"],
        "update_peak_mib": {
            "cp1": round(one["update_peak_bytes"] / 2**20, 1),
            "cp2": round(two["update_peak_bytes"] / 2**20, 1),
        },
        "stats_peak_mib": {
            "cp1": round(one["stats_peak_bytes"] / 2**20, 1),
            "cp2": round(two["stats_peak_bytes"] / 2**20, 1),
        },
        "update_s": {"cp1": round(one["update_s"], 3), "cp2": round(two["update_s"], 3)},
        "stats_s": {"cp1": round(one["stats_s"], 3), "cp2": round(two["stats_s"], 3)},
        "cp2_padding": round(two["cp_padding"], 5),
        "cp2_over_cp1_activation_bytes": round(two["update_peak_bytes"] / one["update_peak_bytes"], 3),
        "cp2_over_cp1_stats_bytes": round(two["stats_peak_bytes"] / one["stats_peak_bytes"], 3),
        "cp2_over_cp1_step_time": round(two["update_s"] / one["update_s"], 3),
        "grad_max_rel_diff": float(f"{result['grad_max_rel_diff']:.3g}"),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
