"""Benchmark: the actor's passes on right-padded micro-batches against packed ones, on a long-tailed RLVR workload.

One run, one small random Qwen2 at TP=2 over gloo (2 processes), the same weights and the same rollouts for both:
  padded   today's layout: the step's batch right-padded to its longest sequence S, ``micro_batch_size`` sequences
           per micro-batch (actor.pack_sequences=false)
  packed   one THD stream per micro-batch under ``max_tokens_per_micro_batch = micro_batch_size * S`` real tokens:
           the same micro-batch memory bound (actor.pack_sequences=true)
Rollout lengths are lognormal with a tail up to the budget S (one sequence is exactly S long). Reported per layout:
tokens computed / real tokens, the statistics pass (compute_old_logp) and the update (actor.update, one mini-batch,
lr = 0 so every repeat starts from the same weights), medians of repeats after a warm-up, and the peak extra bytes
a pass allocates (counted by a dispatch mode in a separate, untimed call). grad_max_rel_diff compares the two
updates' gradients: max |packed - padded| / max |padded|. The last line is one JSON object.

    python tools/benches/bench_packing.py            # 48 rollouts up to 768 tokens, a 2-layer model of width 256
    python tools/benches/bench_packing.py --quick    # 32 rollouts up to 384 tokens, the tiny test model; ~1.5 minutes here
    python tools/benches/bench_packing.py --hf-dir megatron_rlvr/demo/model --sequences 64 --max-len 56 --median-len 40 \
        --prompt-len 20 --micro-batch-size 8      # the demo's shapes: short rollouts, little padding to remove
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
    sequences: int = 48
    max_len: int = 768  # S: the budget of one sequence, the padded length
    median_len: int = 128
    sigma: float = 0.9
    prompt_len: int = 48
    micro_batch_size: int = 2
    repeats: int = 3
    model: dict = dataclasses.field(
        default_factory=lambda: dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=4096,
        )
    )
    seed: int = 0


QUICK = dict(sequences=32, max_len=384, median_len=64, prompt_len=24, micro_batch_size=2, repeats=2, model={})


def workload_lengths(cfg: BenchConfig) -> list[int]:
    """Lognormal total lengths in [prompt + 1, S], one of them exactly S (the tail reaches the budget)."""
    g = torch.Generator().manual_seed(cfg.seed)
    raw = torch.exp(math.log(cfg.median_len) + cfg.sigma * torch.randn(cfg.sequences, generator=g))
    lengths = [int(min(cfg.max_len, max(cfg.prompt_len + 1, round(float(x))))) for x in raw]
    lengths[int(torch.randint(0, cfg.sequences, (1,), generator=g))] = cfg.max_len
    return lengths


def make_batch(lengths: list[int], vocab: int, prompt_len: int, seed: int):
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


def _worker(hf_dir: str, cfg: BenchConfig, lengths: list[int]) -> dict[str, Any]:
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.runtime.distributed import model_parallel

    budget = cfg.micro_batch_size * cfg.max_len
    with model_parallel(tp=2, pp=1, seed=1):
        actor = MegatronActor(
            ModelConfig(hf_dir=hf_dir),
            ActorConfig(tp=2, lr=0.0, micro_batch_size=cfg.micro_batch_size),
            algo_config({"loss.kind": "casp", "loss.agg": "token_mean"}),
            temperature=1.0,
            total_steps=1,
        )
        batch, targets = make_batch(lengths, actor.vocab_size, cfg.prompt_len, cfg.seed)
        results: dict[str, Any] = {}
        for name, packed in (("padded", False), ("packed", True)):
            actor.cfg.pack_sequences = packed
            actor.cfg.max_tokens_per_micro_batch = budget if packed else 0
            _, micro = actor.passes.plan(batch)
            computed = sum(m.packed.num_tokens if m.packed else m.seqs.tokens.numel() for m in micro)
            statistics = actor.statistics_pass(batch)
            stats_s = _median_seconds(lambda: actor.compute_old_logp(batch), cfg.repeats)
            update_s = _median_seconds(lambda: actor.update(batch, targets, statistics, mini_batches=1), cfg.repeats)
            stats_bytes = _peak_bytes(lambda: actor.compute_old_logp(batch))
            update_bytes = _peak_bytes(lambda: actor.update(batch, targets, statistics, mini_batches=1))
            grads = torch.cat([p.main_grad.reshape(-1).clone() for c in actor.model for p in c.module.parameters()])
            results[name] = dict(
                micro_batches=len(micro),
                tokens_computed=computed,
                stats_s=stats_s,
                update_s=update_s,
                stats_peak_bytes=stats_bytes,
                update_peak_bytes=update_bytes,
                grads=grads,
            )
        diff = (results["packed"]["grads"] - results["padded"]["grads"]).abs().max()
        results["grad_max_rel_diff"] = float(diff / results["padded"]["grads"].abs().max())
        for name in ("padded", "packed"):
            del results[name]["grads"]
        return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller workload and the tiny test model")
    parser.add_argument("--sequences", type=int)
    parser.add_argument("--max-len", type=int)
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--median-len", type=int)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--hf-dir", help="an existing HF model directory instead of a random Qwen2 (e.g. the demo's)")
    args = parser.parse_args(argv)
    cfg = BenchConfig(**QUICK) if args.quick else BenchConfig()
    for key in ("sequences", "max_len", "micro_batch_size", "repeats", "median_len", "prompt_len"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))

    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model
    from megatron_rlvr.testing.workers import WorkerGroup

    lengths = workload_lengths(cfg)
    real = sum(lengths)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.hf_dir or str(make_tiny_hf_model("qwen2", Path(tmp) / "model", seed=cfg.seed, **cfg.model))
        with WorkerGroup(2, timeout_s=1800) as group:
            result = group.run(_worker, hf_dir, cfg, lengths)[0]
    pad, pk = result["padded"], result["packed"]
    print(
        f"workload: {cfg.sequences} rollouts, lengths lognormal (median {cfg.median_len}, sigma {cfg.sigma}) in "
        f"[{min(lengths)}, {max(lengths)}], {real} real tokens; TP=2 over gloo; micro-batch memory bound "
        f"{cfg.micro_batch_size} x {cfg.max_len} = {cfg.micro_batch_size * cfg.max_len} tokens"
    )
    print(
        f"{'layout':8} {'micro-batches':>13} {'computed/real':>13} {'statistics s':>12} {'update s':>9} "
        f"{'stats peak MiB':>14} {'update peak MiB':>15}"
    )
    for name, r in (("padded", pad), ("packed", pk)):
        print(
            f"{name:8} {r['micro_batches']:13d} {r['tokens_computed'] / real:13.2f} {r['stats_s']:12.2f} "
            f"{r['update_s']:9.2f} {r['stats_peak_bytes'] / 2**20:14.1f} {r['update_peak_bytes'] / 2**20:15.1f}"
        )
    summary = {
        "sequences": cfg.sequences,
        "max_len": cfg.max_len,
        "real_tokens": real,
        "micro_batch_tokens": cfg.micro_batch_size * cfg.max_len,
        "padded_over_real_tokens": round(pad["tokens_computed"] / real, 3),
        "packed_over_real_tokens": round(pk["tokens_computed"] / real, 3),
        "stats_s": {"padded": round(pad["stats_s"], 3), "packed": round(pk["stats_s"], 3)},
        "update_s": {"padded": round(pad["update_s"], 3), "packed": round(pk["update_s"], 3)},
        "stats_speedup_vs_padded": round(pad["stats_s"] / pk["stats_s"], 2),
        "update_speedup_vs_padded": round(pad["update_s"] / pk["update_s"], 2),
        "stats_peak_mib": {
            "padded": round(pad["stats_peak_bytes"] / 2**20, 1),
            "packed": round(pk["stats_peak_bytes"] / 2**20, 1),
        },
        "update_peak_mib": {
            "padded": round(pad["update_peak_bytes"] / 2**20, 1),
            "packed": round(pk["update_peak_bytes"] / 2**20, 1),
        },
        "grad_max_rel_diff": float(f"{result['grad_max_rel_diff']:.3g}"),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
