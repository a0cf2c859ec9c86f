"""Test hook for the local-Slurm eval test: with this directory on PYTHONPATH and MEGATRON_RLVR_TEST_EVAL_STALL_S
set, every eval rank stores its first chunk of samples, then stalls that long before it stores its second (drawn,
not yet written), so the test's `scancel` lands mid-run at a known point however fast the machine draws: without it
an unloaded machine finished the whole eval before the cancel arrived. Nothing else changes: the samples stored
are the real ones, through the store's own `append`."""

import importlib.abc
import importlib.machinery
import os
import sys
import time

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
            for store in _STORES:
                cls = getattr(module, store)
                cls.append = _stalling(cls.append)

        spec.loader.exec_module = exec_and_patch
        return spec


if _STALL > 0 and "RANK" in os.environ:  # the ranks only, not torchrun
    sys.meta_path.insert(0, _PatchOnImport())
