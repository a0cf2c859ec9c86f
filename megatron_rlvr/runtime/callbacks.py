"""Callbacks on named events of a run, from the modules that $MEGATRON_RLVR_CALLBACKS lists.

``MEGATRON_RLVR_CALLBACKS="pkg.mod_a,pkg.mod_b"`` (importable module names; the processes torchrun and Slurm start
inherit it): the first time an event fires in a process, each module is imported and its ``register(callbacks)``
is called, which adds functions to events with ``callbacks.on(event, fn)``. An event calls its functions in order
with its keyword arguments. With the variable unset nothing is imported and nothing runs.

The events, where they fire, and what they pass:

- ``actor.before_update``: `MegatronActor.update`, before the step's update (``actor``);
- ``checkpoint.before_save``: `checkpoint.save`, before anything is written (``directory``, ``step``);
- ``eval.before_store``: an eval rank's store, before a chunk of samples is written (``records``, the chunk).

They are for what a run's own code has no reason to do, at a known point inside processes a launcher starts: the
tests make a step, a checkpoint or an eval chunk take longer there (tests/system/runtime/slow_step.py,
tests/system/launch/slow_checkpoint.py, tests/system/launch/stalled_eval.py). A callback must not change what the run computes.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from megatron_rlvr.errors import UserError

ENV_VAR = "MEGATRON_RLVR_CALLBACKS"
EVENTS = ("actor.before_update", "checkpoint.before_save", "eval.before_store")

Callback = Callable[..., None]


class Callbacks:
    """The functions registered on each event."""

    def __init__(self) -> None:
        self._on: dict[str, list[Callback]] = {event: [] for event in EVENTS}

    def on(self, event: str, fn: Callback) -> None:
        """Call ``fn(**arguments)`` each time ``event`` fires, after the functions registered before it."""
        if event not in self._on:
            raise ValueError(f"callback event {event!r}: expected one of {EVENTS}")
        self._on[event].append(fn)

    def fire(self, event: str, **arguments) -> None:
        for fn in self._on[event]:
            fn(**arguments)


def load(names: str) -> Callbacks:
    """The callbacks that the comma-separated modules ``names`` register."""
    callbacks = Callbacks()
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise UserError(f"${ENV_VAR}: cannot import {name!r}: {exc}") from exc
        register = getattr(module, "register", None)
        if not callable(register):
            raise UserError(f"${ENV_VAR}: module {name!r} has no register(callbacks) function")
        register(callbacks)
    return callbacks


_process: Callbacks | None = None


def fire(event: str, **arguments) -> None:
    """Fire ``event`` in this process: the callbacks of $MEGATRON_RLVR_CALLBACKS (loaded the first time)."""
    global _process
    if event not in EVENTS:
        raise ValueError(f"callback event {event!r}: expected one of {EVENTS}")
    if _process is None:
        _process = load(os.environ.get(ENV_VAR, ""))
    _process.fire(event, **arguments)
