"""The demo recipe's training command under torchrun on local processes: what the tests and the benchmarks start as
a process of their own, signal or kill."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

# a checkout's recipe: the tests and the benchmarks run from one
DEMO_RECIPE = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


def demo_train_command(overrides: Sequence[str], nproc: int = 2) -> list[str]:
    """`torchrun --standalone --nproc-per-node=nproc -m megatron_rlvr.cli train configs/demo_cpu.yaml overrides`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "megatron_rlvr.cli",
        "train",
        str(DEMO_RECIPE),
        *overrides,
    ]
