"""Callbacks from $MEGATRON_RLVR_CALLBACKS: modules register functions on named events, which fire in order; a
module that cannot be imported or registers nothing, and an unknown event, are one-line errors."""

from __future__ import annotations

import pytest

from megatron_rlvr.errors import UserError
from megatron_rlvr.runtime.callbacks import EVENTS, Callbacks, load


def test_modules_register_on_events_that_fire_in_order(tmp_path, monkeypatch):
    (tmp_path / "first_callbacks.py").write_text(
        "SEEN = []\n"
        "def register(callbacks):\n"
        "    callbacks.on('checkpoint.before_save', lambda directory, step: SEEN.append(('first', step)))\n"
    )
    (tmp_path / "second_callbacks.py").write_text(
        "from first_callbacks import SEEN\n"
        "def register(callbacks):\n"
        "    callbacks.on('checkpoint.before_save', lambda directory, step: SEEN.append(('second', step)))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    callbacks = load(" first_callbacks, second_callbacks ,")
    callbacks.fire("checkpoint.before_save", directory=tmp_path, step=3)
    callbacks.fire("actor.before_update", actor=None)  # nothing registered there: nothing runs
    import first_callbacks

    assert first_callbacks.SEEN == [("first", 3), ("second", 3)]


def test_bad_modules_and_events_are_one_line_errors(tmp_path, monkeypatch):
    (tmp_path / "no_register.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"\$MEGATRON_RLVR_CALLBACKS: cannot import 'no_such_callbacks'"):
        load("no_such_callbacks")
    with pytest.raises(UserError, match=r"module 'no_register' has no register\(callbacks\) function"):
        load("no_register")
    with pytest.raises(ValueError, match=r"callback event 'actor.after_update': expected one of"):
        Callbacks().on("actor.after_update", print)
    assert "actor.before_update" in EVENTS
