"""`megatron-rlvr data prepare countdown --out FILE.jsonl`: a split of the embedded demo task as a benchmark file.

    megatron-rlvr data prepare countdown --out data/countdown.jsonl                    # what eval_cpu reads
    megatron-rlvr data prepare countdown --out data/countdown.jsonl --split eval --count 512 --seed 1234

Contract: writes ``count`` rows ``{"id", "numbers", "target"}`` of ``split`` from the seeded generator in
``megatron_rlvr.tasks.countdown`` (the ``countdown`` benchmark layout of ``megatron_rlvr.problems.benchmarks``).
The defaults (the eval split, 512 problems, the recipes' data seed) are the prompts `megatron-rlvr demo` evaluates
on, so an eval of ``data/countdown.jsonl`` scores the demo's own evaluation problems. The file is replaced
atomically.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from megatron_rlvr.data.config import DataConfig
from megatron_rlvr.data.sources import DataError
from megatron_rlvr.tasks.countdown import generate

DEFAULT_COUNT = 512  # the demo's --eval-prompts: the eval split holds ~620 problems


def countdown_rows(split: str, count: int, seed: int) -> list[dict]:
    """``count`` problems of ``split`` as benchmark rows, deterministic in ``seed``."""
    if count < 1:
        raise DataError(f"--count {count}: expected at least 1 problem")
    try:
        problems = generate(seed, count, split)  # type: ignore[arg-type]  # the parser restricts split
    except RuntimeError as e:  # the split is exhausted before `count` problems
        raise DataError(f"--count {count}: {e}") from None
    return [{"id": p.id, "numbers": list(p.numbers), "target": p.target} for p in problems]


def write_rows(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rlvr data prepare countdown", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSONL file to write, e.g. data/countdown.jsonl")
    parser.add_argument("--split", default="eval", choices=["eval", "train"], help="which split (default: eval)")
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT, help=f"problems (default: {DEFAULT_COUNT})")
    parser.add_argument(
        "--seed",
        type=int,
        default=DataConfig.seed,
        help=f"generator seed (default: {DataConfig.seed}, the recipes' data.seed)",
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    rows = countdown_rows(args.split, args.count, args.seed)
    write_rows(rows, Path(args.out))
    print(f"countdown: wrote {len(rows)} {args.split} problems (seed {args.seed}) to {args.out}")
    return 0
