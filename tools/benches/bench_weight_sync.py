"""Weight-sync time of a random ~0.3B model from a TP=2 Megatron actor into a CPU vLLM engine, beside a plain copy of
the same bytes, measured in one run on the same ranks and threads.

    .venv/bin/python tools/benches/bench_weight_sync.py [--layers 20] [--repeats 3] [--bucket-mb 256] [--check]

Rank 0 holds the engine; both ranks run the bridge's export (TP gather + HF re-layout; rank 1 passes
``receive=False``: it only serves its shards, as a rank without an engine) and rank 0 feeds it to
``engine.update_weights`` (validation, the engine's weight load, prefix-cache reset). The sync lends
(``export_hf_weights(lend=True)`` into ``update_weights(lent=True)``): both ranks write their shards' HF pieces into
shared memory and rank 0's engine reads them there, while rank 1 lays out the next round. The copy baseline copies the
same HF tensors into preallocated tensors of the same shapes on rank 0. Also printed, to show where the time goes:
the export alone (drained, no engine), the export with every rank receiving (the CPU trainer, where each rank holds
an engine), and the engine update alone (from tensors already in memory). The last line is one JSON object with
sync_seconds, copy_seconds and sync_over_copy (target <= 2), and the breakdown of one more sync by part.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH_MODEL = dict(  # Qwen2 layout, ~0.3B parameters with 20 layers
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Breakdown:
    """Seconds of one sync by part, on the engine's rank: time inside the export's iterator (TP gather + HF
    re-layout), the manifest's checks, the GEMM handle rebuild (vLLM's CPU dispatch), the prefix-cache reset; the
    rest of ``update_weights`` is the plain-parameter copies, the commit and the loop itself. Timing wrappers are
    installed only for the breakdown round (they cost a little themselves)."""

    PARTS = ("export", "manifest_checks", "gemm_handles", "prefix_cache_reset")

    def __init__(self, engine) -> None:
        self.engine = engine
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self._undo: list = []

    def _wrap(self, owner, attr: str, part: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def export(self, stream):
        it = iter(stream)
        while True:
            start = time.perf_counter()
            item = next(it, None)
            self.seconds["export"] += time.perf_counter() - start
            if item is None:
                return
            yield item

    def __enter__(self) -> Breakdown:
        from megatron_rlvr.rollout import weight_manifest
        from megatron_rlvr.rollout.cpu import weights as cpu_weights

        self._wrap(weight_manifest._StreamChecker, "check", "manifest_checks")
        self._wrap(weight_manifest._StreamChecker, "finish", "manifest_checks")
        self._wrap(cpu_weights, "_prepared_gemm", "gemm_handles")
        self._wrap(self.engine._llm, "reset_prefix_cache", "prefix_cache_reset")
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self._undo):
            if owner is self.engine._llm:
                delattr(owner, attr)  # the instance attribute hid the class's method
            else:
                setattr(owner, attr, fn)


def bench_rank(hf_dir: str, repeats: int, bucket_bytes: int, check: bool, staging: str) -> dict | None:
    """On every rank of a 2-rank gloo group: build the TP=2 actor, then time export+sync, export, update, copy."""
    import torch.distributed as dist

    from megatron_rlvr.bridge import export_hf_weights
    from megatron_rlvr.models import build_gpt_model, load_hf_config, transformer_config_from_hf
    from megatron_rlvr.runtime import distributed

    distributed.initialize_model_parallel(tp=2, pp=1, seed=0)
    hf = load_hf_config(hf_dir)
    model = build_gpt_model(hf, transformer_config_from_hf(hf, tp=2, pp=1))  # random weights: any values sync
    chunks = [model]
    rank = dist.get_rank()
    engine = None
    if rank == 0:
        from megatron_rlvr.rollout import RolloutConfig, make_engine

        cfg = RolloutConfig(max_model_len=512, kv_cache_memory_bytes=64 << 20, sync_staging=staging)
        engine = make_engine(hf_dir, cfg)

    def export(everyone: bool = False, lend: bool = False):
        receive = everyone or engine is not None
        buckets = export_hf_weights(chunks, hf, bucket_bytes=bucket_bytes, receive=receive, lend=lend)
        return itertools.chain.from_iterable(buckets)

    def sync():
        if engine is not None:
            engine.update_weights(export(lend=True), lent=True)
        else:
            for _ in export(lend=True):
                pass

    def export_only():
        for _ in export(lend=True):
            pass

    def export_everyone():
        for _ in export(everyone=True):
            pass

    results: dict[str, list[float]] = {"sync": [], "export": [], "export_everyone": [], "update": [], "copy": []}
    held = list(export())  # HF tensors in memory: the source of the update-only and copy timings
    nbytes = sum(t.numel() * t.element_size() for _, t in held)
    targets = [torch.empty_like(t) for _, t in held]

    def copy():
        for dst, (_, src) in zip(targets, held):
            dst.copy_(src)

    # One untimed round first: every timed run then writes into memory that is already mapped, as a trainer's
    # syncs after its first do (a first touch of fresh memory costs more than the copy itself on this machine).
    for rnd in range(1 + repeats):
        for name, fn in (("sync", sync), ("export", export_only), ("export_everyone", export_everyone)):
            dist.barrier()
            elapsed = _timed(fn)
            if rnd:
                results[name].append(elapsed)
        dist.barrier()
        if engine is not None:
            update, copied = _timed(lambda: engine.update_weights(held)), _timed(copy)
            if rnd:
                results["update"].append(update)
                results["copy"].append(copied)
    breakdown = None  # one more sync, timed by part
    dist.barrier()
    if engine is not None:
        with Breakdown(engine) as parts:
            start = time.perf_counter()
            engine.update_weights(parts.export(export(lend=True)), lent=True)
            total = time.perf_counter() - start
        breakdown = {"total": total, **parts.seconds}
        breakdown["update_rest"] = total - sum(parts.seconds.values())
    else:
        sync()
    mismatches = None
    if check:  # after one more sync (the lent path), since the last update above came from ``held``
        dist.barrier()
        sync()
        mismatches = engine.compare_weights(dict(held)) if engine is not None else None
    start_seconds = engine.start_seconds if engine is not None else None
    if engine is not None:
        engine.close()
    distributed.destroy_model_parallel()
    if rank != 0:
        return None
    return {
        "results": results,
        "bytes": nbytes,
        "tensors": len(held),
        "engine_start_seconds": start_seconds,
        "mismatches": mismatches,
        "breakdown": breakdown,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--check", action="store_true", help="read the engine's weights back after the last sync")
    parser.add_argument("--staging", choices=("full", "streaming"), default="full", help="rollout.sync_staging")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)

    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model
    from megatron_rlvr.testing.workers import WorkerGroup

    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        hf_dir = make_tiny_hf_model("qwen2", Path(tmp) / "model", num_hidden_layers=args.layers, **BENCH_MODEL)
        with WorkerGroup(2, timeout_s=args.timeout) as group:
            out = group.run(bench_rank, str(hf_dir), args.repeats, args.bucket_mb << 20, args.check, args.staging)[0]

    # The machine is shared: the median is the headline, the minimum (least disturbed run) is printed beside it.
    print(f"{args.repeats} timed runs of each after one untimed warm-up round; the sync and the copy alternate")
    med = {k: statistics.median(v) for k, v in out["results"].items()}
    low = {k: min(v) for k, v in out["results"].items()}
    gb = out["bytes"] / 1e9
    print(f"model: {out['tensors']} HF tensors, {gb:.3f} GB fp32 (~{out['bytes'] / 4e9:.2f}B parameters)")
    print(f"engine start: {out['engine_start_seconds']:.1f} s")
    for key, label in (
        ("sync", "export + engine.update_weights (the sync)"),
        ("export", "export alone (lent, HF layout in shared memory)"),
        ("export_everyone", "export alone, every rank receiving"),
        ("update", "engine.update_weights from memory"),
        ("copy", "plain copy of the same bytes"),
    ):
        runs = ", ".join(f"{x:.3f}" for x in out["results"][key])
        print(f"{label:45s} median {med[key]:7.3f} s  ({gb / med[key]:5.2f} GB/s)  min {low[key]:7.3f} s  runs: {runs}")
    for name, stat in (("median", med), ("min", low)):
        ratios = "  ".join(f"{k}/copy {stat[k] / stat['copy']:.2f}" for k in ("sync", "update", "export"))
        print(f"ratios ({name}): {ratios}")
    b = out["breakdown"]
    print(
        f"breakdown of one more sync ({b['total']:.3f} s, timing wrappers on): "
        + ", ".join(f"{k} {b[k]:.3f} s ({b[k] / b['total']:.0%})" for k in (*Breakdown.PARTS, "update_rest"))
    )
    if out["mismatches"] is not None:
        print(f"post-sync read-back: {len(out['mismatches'])} mismatching tensors {out['mismatches'][:3]}")
    summary = {
        "sync_seconds": round(med["sync"], 4),
        "copy_seconds": round(med["copy"], 4),
        "sync_over_copy": round(med["sync"] / med["copy"], 3),
        "export_seconds": round(med["export"], 4),
        "update_seconds": round(med["update"], 4),
        "bytes": out["bytes"],
        "repeats": args.repeats,
        "bucket_bytes": args.bucket_mb << 20,
        "staging": args.staging,
        "sync_over_copy_min": round(low["sync"] / low["copy"], 3),
        "breakdown_seconds": {k: round(v, 4) for k, v in b.items()},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
