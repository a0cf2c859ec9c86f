"""Test hook for the stop test: with this directory on PYTHONPATH and MEGATRON_RLVR_TEST_STEP_DELAY_S set, every
training rank's actor update (`MegatronActor.update`, once per step) first prints ``[test] rank R: step update`` and
sleeps that long, so a step lasts longer than torchrun's grace before SIGKILL. Nothing else changes: the update and
the checkpoint are the real ones."""

import os
import sys
import time

from megatron_rlvr.testing.import_hooks import patch_after_import

_DELAY = float(os.environ.get("MEGATRON_RLVR_TEST_STEP_DELAY_S", "0") or 0)


def _slowed(update):
    def update_slowly(self, *args, **kwargs):
        print(f"[test] rank {os.environ.get('RANK')}: step update, {_DELAY:g} s more", file=sys.stderr, flush=True)
        time.sleep(_DELAY)
        return update(self, *args, **kwargs)

    return update_slowly


def _patch(module):
    module.MegatronActor.update = _slowed(module.MegatronActor.update)


if _DELAY > 0 and "RANK" in os.environ:  # the ranks only, not the launcher
    patch_after_import("megatron_rlvr.actor.megatron_actor", _patch)
