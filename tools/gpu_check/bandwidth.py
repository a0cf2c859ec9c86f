"""The GPU's memory bandwidth as torch reaches it, measured in the same call as the op bench: the bytes-read bound.

The fused op must read the logits at least once, so ``logits bytes / read bandwidth`` is a time no implementation
beats; summary.py sets the bench's figures against it. Read: ``x.sum()`` over a buffer many times the L2 (bytes read
/ time); copy: ``y.copy_(x)`` (bytes read + written / time). Median of ``--repeats`` after a warm-up, CUDA events.

    python tools/gpu_check/bandwidth.py --out /tmp/bw.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0, help="buffer size (the H200's L2 is 60 MB)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    return p


def preflight(args: argparse.Namespace) -> list[str]:
    if args.gib <= 0 or args.repeats < 1:
        raise SystemExit(f"bandwidth: --gib {args.gib} and --repeats {args.repeats} must be positive")
    import torch  # noqa: F401

    return []


def median_ms(fn, repeats: int) -> float:
    import torch

    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bandwidth: needs CUDA")
    n = int(args.gib * 2**30) // 4
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    read_ms = median_ms(lambda: x.sum(), args.repeats)
    copy_ms = median_ms(lambda: y.copy_(x), args.repeats)
    result = {
        "env": common.environment(),
        "buffer_bytes": nbytes,
        "read_ms": round(read_ms, 4),
        "copy_ms": round(copy_ms, 4),
        "read_gb_per_s": round(nbytes / read_ms / 1e6, 1),
        "copy_gb_per_s": round(2 * nbytes / copy_ms / 1e6, 1),
    }
    common.write_json(args.out, result)
    print(f"bandwidth: read {result['read_gb_per_s']} GB/s, copy (read + write) {result['copy_gb_per_s']} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
