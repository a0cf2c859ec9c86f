"""Test hook for the local-Slurm preemption test: with this directory on PYTHONPATH and
MEGATRON_RLVR_TEST_CHECKPOINT_DELAY_S set, every training rank's `megatron_rlvr.checkpoint.save` in the job's first
run first sleeps that long, so the stop's checkpoint takes longer than torchrun's default 30 s before SIGKILL (the
hazard the launcher must avoid). The requeued rerun (SLURM_RESTART_COUNT >= 1) saves at its normal pace: its
checkpoints are not the ones signalled. Nothing else changes: the checkpoint written is the real one."""

import importlib.abc
import importlib.machinery
import os
import sys
import time

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


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            module.save = _slowed(module.save)

        spec.loader.exec_module = exec_and_patch
        return spec


_FIRST_RUN = os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0")

if _DELAY > 0 and _FIRST_RUN and "RANK" in os.environ:  # the first run's ranks only, not torchrun
    sys.meta_path.insert(0, _PatchOnImport())
