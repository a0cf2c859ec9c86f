#!/usr/bin/env python
"""Peak resident memory of tools/convert.py in both directions on a random model (default ~0.5B parameters,
Qwen2-0.5B's shapes, bf16), against the model's and its largest tensor's size. Prints figures; the last line is
one JSON object. The conversion must not scale with the model: growth should stay near 2x the largest tensor."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

QWEN2_0_5B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
)


def _convert(args: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert.py"), *args, "--report-memory"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if proc.returncode != 0:
        raise SystemExit(f"convert {args[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=None, help="default: a temp dir, removed at the end")
    p.add_argument("--layers", type=int, default=QWEN2_0_5B["num_hidden_layers"])
    args = p.parse_args(argv)
    from megatron_rlvr.bridge.mapping import hf_shapes, mapping_table
    from megatron_rlvr.models.dims import ModelDims
    from megatron_rlvr.testing.tiny_models import write_random_hf_checkpoint

    work = args.workdir or Path(tempfile.mkdtemp(prefix="convert_memory_"))
    try:
        overrides = {**QWEN2_0_5B, "num_hidden_layers": args.layers}
        hf_dir = write_random_hf_checkpoint(
            "qwen2", work / "hf", dtype=torch.bfloat16, max_shard_size=2 * 10**9, **overrides
        )
        hf = json.loads((hf_dir / "config.json").read_text())
        dims = ModelDims.from_hf(hf)
        sizes = [
            2 * torch.Size(s).numel()
            for m in mapping_table(dims)
            if m.megatron != "output_layer.weight"
            for s in hf_shapes(m, dims)
        ]
        model_bytes, largest = sum(sizes), max(sizes)
        to_mcore = _convert(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(work / "mcore")])
        to_hf = _convert(["mcore-to-hf", "--mcore-dir", str(work / "mcore"), "--out", str(work / "hf_back")])
        mb = 2**20
        result = {
            "params": model_bytes // 2,
            "model_mb": round(model_bytes / mb, 1),
            "largest_tensor_mb": round(largest / mb, 1),
            "hf_to_mcore_growth_mb": round((to_mcore["peak_rss_bytes"] - to_mcore["rss_start_bytes"]) / mb, 1),
            "mcore_to_hf_growth_mb": round((to_hf["peak_rss_bytes"] - to_hf["rss_start_bytes"]) / mb, 1),
            "hf_to_mcore_peak_mb": round(to_mcore["peak_rss_bytes"] / mb, 1),
            "mcore_to_hf_peak_mb": round(to_hf["peak_rss_bytes"] / mb, 1),
        }
        for k, v in result.items():
            print(f"{k:>24}: {v}")
        print(json.dumps(result))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
