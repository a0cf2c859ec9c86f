"""Callbacks for the stop test (MEGATRON_RLVR_CALLBACKS=tests.system.runtime.slow_step, runtime/callbacks.py): with
MEGATRON_RLVR_TEST_STEP_DELAY_S set, every training rank's actor update (once per step) first prints
``[test] rank R: step update`` and sleeps that long, so a step lasts longer than torchrun's grace before SIGKILL.
Nothing else changes: the update and the checkpoint are the real ones."""

import os
import sys
import time

from megatron_rlvr.runtime.callbacks import Callbacks


def register(callbacks: Callbacks) -> None:
    delay = float(os.environ.get("MEGATRON_RLVR_TEST_STEP_DELAY_S", "0") or 0)

    def update_slowly(actor) -> None:
        print(f"[test] rank {os.environ.get('RANK')}: step update, {delay:g} s more", file=sys.stderr, flush=True)
        time.sleep(delay)

    if delay > 0 and "RANK" in os.environ:  # the ranks only, not the launcher
        callbacks.on("actor.before_update", update_slowly)
