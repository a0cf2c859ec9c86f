"""Test hook for the local-Slurm preemption test: with this directory on PYTHONPATH and
MEGATRON_RLVR_TEST_CHECKPOINT_DELAY_S set, every training rank's `megatron_rlvr.checkpoint.save` in the job's first
run first sleeps that long, so the stop's checkpoint takes longer than torchrun's default 30 s before SIGKILL (the
hazard the launcher must avoid). The requeued rerun (SLURM_RESTART_COUNT >= 1) saves at its normal pace: its
checkpoints are not the ones signalled. Nothing else changes: the checkpoint written is the real one."""

import os
import sys
import time

from megatron_rlvr.testing.import_hooks import patch_after_import

_DELAY = float(os.environ.get("MEGATRON_RLVR_TEST_CHECKPOINT_DELAY_S", "0") or 0)
_MODULE = "megatron_rlvr.checkpoint"


def _slowed(save):
    def save_slowly(*args, **kwargs):
        print(
            f"[test] rank {os.environ.get('RANK')}: the checkpoint takes {_DELAY:.0f} s more",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(_DELAY)
        return save(*args, **kwargs)

    return save_slowly


_FIRST_RUN = os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0")

if _DELAY > 0 and _FIRST_RUN and "RANK" in os.environ:  # the first run's ranks only, not torchrun
    patch_after_import(_MODULE, lambda module: setattr(module, "save", _slowed(module.save)))
