"""The demo recipe trained under torchrun on 2 local processes, as a process of its own: what the separate-placement
and fully asynchronous tests start, signal or kill, and read back."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from megatron_rlvr.testing.demo_command import demo_train_command

REPO = Path(__file__).resolve().parents[3]
QUIET = ("trainer.eval_every=0", "trainer.tensorboard=false", "trainer.save_hf=false")  # the steps alone


def start_demo_training(
    out: Path, steps: int, overrides: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`megatron-rlvr train configs/demo_cpu.yaml` for ``steps`` steps into ``out``, with ``overrides`` last, its
    output in ``log``; in a session of its own, so that a test can signal or kill the whole group."""
    cmd = demo_train_command([f"trainer.steps={steps}", *QUIET, f"trainer.output_dir={out}", *overrides])
    with open(log, "w") as handle:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )


def logged_metrics(out: Path) -> list[dict]:
    """The metrics rank 0 has logged so far (none before the first step)."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
