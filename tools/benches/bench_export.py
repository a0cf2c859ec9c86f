#!/usr/bin/env python
"""Weight export from a TP=2 Megatron actor on CPU (gloo): the gathered HF export (``export_hf_weights``) beside
the same-TP local hand-over (``export_local_shards``, no all-gather) and a plain copy of the same bytes, on a
random model (default ~0.3B parameters, fp32). Prints figures; the last line is one JSON object."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

SHAPES_0_3B = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=False,
)


def _worker(hf_dir: str, tp: int, bucket_bytes: int, repeats: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rlvr.bridge import export_hf_weights, export_local_shards, load_hf_weights
    from megatron_rlvr.models import build_gpt_model, load_hf_config, transformer_config_from_hf
    from megatron_rlvr.runtime import distributed

    distributed.initialize_model_parallel(tp=tp, pp=1)
    try:
        hf = load_hf_config(hf_dir)
        model = build_gpt_model(hf, transformer_config_from_hf(hf, tp=tp, pp=1))
        load_hf_weights([model], hf_dir)

        def timed(fn) -> tuple[float, int]:
            best, nbytes = float("inf"), 0
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                nbytes = fn()
                dist.barrier()
                best = min(best, time.perf_counter() - t0)
            return best, nbytes

        gathered = timed(
            lambda: sum(
                t.numel() * t.element_size()
                for b in export_hf_weights([model], hf, bucket_bytes=bucket_bytes)
                for _, t in b
            )
        )
        local = timed(
            lambda: sum(
                s.tensor.numel() * s.tensor.element_size()
                for b in export_local_shards([model], hf, bucket_bytes=bucket_bytes)
                for s in b
            )
        )
        params = [p.detach() for p in model.parameters()]
        copy = timed(lambda: sum(p.clone().numel() * p.element_size() for p in params))
        return {
            "rank": dist.get_rank(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "gathered_s": gathered[0],
            "gathered_bytes": gathered[1],
            "local_s": local[0],
            "local_bytes": local[1],
            "copy_own_shard_s": copy[0],
            "own_shard_bytes": copy[1],
        }
    finally:
        distributed.destroy_model_parallel()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=SHAPES_0_3B["num_hidden_layers"])
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    import torch

    from megatron_rlvr.testing.tiny_models import write_random_hf_checkpoint
    from megatron_rlvr.testing.workers import WorkerGroup

    work = Path(tempfile.mkdtemp(prefix="bench_export_"))
    try:
        hf_dir = write_random_hf_checkpoint(
            "llama",
            work / "hf",
            dtype=torch.float32,
            **{**SHAPES_0_3B, "num_hidden_layers": args.layers, "rope_scaling": None},
        )
        with WorkerGroup(args.tp, timeout_s=1200) as group:
            results = group.run(_worker, str(hf_dir), args.tp, args.bucket_mb << 20, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r0 = results[0]
    summary = {
        "tp": args.tp,
        "model_mb": round(r0["gathered_bytes"] / 2**20, 1),
        "gathered_export_s": round(max(r["gathered_s"] for r in results), 3),
        "local_shards_export_s": round(max(r["local_s"] for r in results), 3),
        "copy_own_shard_s": round(max(r["copy_own_shard_s"] for r in results), 3),
        "local_shard_mb_per_rank": round(r0["local_bytes"] / 2**20, 1),
    }
    summary["gathered_over_local"] = round(summary["gathered_export_s"] / summary["local_shards_export_s"], 2)
    for k, v in summary.items():
        print(f"{k:>24}: {v}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
