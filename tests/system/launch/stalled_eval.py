"""Callbacks for the local-Slurm eval test (MEGATRON_RLVR_CALLBACKS=tests.system.launch.stalled_eval,
runtime/callbacks.py): with MEGATRON_RLVR_TEST_EVAL_STALL_S set, every eval rank stores its first chunk of samples,
then stalls that long before it stores its second (drawn, not yet written), so the test's `scancel` lands mid-run
at a known point however fast the machine draws: without it an unloaded machine finished the whole eval before the
cancel arrived. Nothing else changes: the samples stored are the real ones."""

import os
import sys
import time

from megatron_rlvr.runtime.callbacks import Callbacks


def register(callbacks: Callbacks) -> None:
    stall = float(os.environ.get("MEGATRON_RLVR_TEST_EVAL_STALL_S", "0") or 0)
    chunks = 0

    def store_or_stall(records) -> None:
        nonlocal chunks
        chunks += 1
        if chunks == 2:
            rank = os.environ.get("RANK")
            print(
                f"[test] rank {rank}: stalls {stall:.0f} s before storing its second chunk", file=sys.stderr, flush=True
            )
            time.sleep(stall)

    if stall > 0 and "RANK" in os.environ:  # the ranks only, not torchrun
        callbacks.on("eval.before_store", store_or_stall)
