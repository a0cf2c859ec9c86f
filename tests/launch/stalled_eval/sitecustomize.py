"""Test hook for the local-Slurm eval test: with this directory on PYTHONPATH and MEGATRON_RLVR_TEST_EVAL_STALL_S
set, every eval rank stores its first chunk of samples, then stalls that long before it stores its second (drawn,
not yet written), so the test's `scancel` lands mid-run at a known point however fast the machine draws: without it
an unloaded machine finished the whole eval before the cancel arrived. Nothing else changes: the samples stored
are the real ones, through the store's own `append`."""

import os
import sys
import time

from megatron_rlvr.testing.import_hooks import patch_after_import

_STALL = float(os.environ.get("MEGATRON_RLVR_TEST_EVAL_STALL_S", "0") or 0)
_MODULE = "megatron_rlvr.eval.store"
_STORES = ("SampleStore", "ShardWriter")  # rank 0's store and the other engine replicas' writers
_appends = 0


def _stalling(append):
    def append_or_stall(self, records):
        global _appends
        records = list(records)
        _appends += 1
        if _appends == 2:
            print(
                f"[test] rank {os.environ.get('RANK')}: stalls {_STALL:.0f} s before storing its second chunk",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(_STALL)
        return append(self, records)

    return append_or_stall


def _stall_stores(module) -> None:
    for store in _STORES:
        cls = getattr(module, store)
        cls.append = _stalling(cls.append)


if _STALL > 0 and "RANK" in os.environ:  # the ranks only, not torchrun
    patch_after_import(_MODULE, _stall_stores)
