"""Callbacks for the local-Slurm preemption test (MEGATRON_RLVR_CALLBACKS=tests.system.launch.slow_checkpoint,
runtime/callbacks.py): with MEGATRON_RLVR_TEST_CHECKPOINT_DELAY_S set, every training rank's checkpoint save in the
job's first run first sleeps that long, so the stop's checkpoint takes longer than torchrun's default 30 s before
SIGKILL (the hazard the launcher must avoid). The requeued rerun (SLURM_RESTART_COUNT >= 1) saves at its normal pace:
its checkpoints are not the ones signalled. Nothing else changes: the checkpoint written is the real one."""

import os
import sys
import time

from megatron_rlvr.runtime.callbacks import Callbacks


def register(callbacks: Callbacks) -> None:
    delay = float(os.environ.get("MEGATRON_RLVR_TEST_CHECKPOINT_DELAY_S", "0") or 0)
    first_run = os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0")

    def save_slowly(directory, step) -> None:
        print(
            f"[test] rank {os.environ.get('RANK')}: the checkpoint takes {delay:.0f} s more",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(delay)

    if delay > 0 and first_run and "RANK" in os.environ:  # the first run's ranks only, not torchrun
        callbacks.on("checkpoint.before_save", save_slowly)
