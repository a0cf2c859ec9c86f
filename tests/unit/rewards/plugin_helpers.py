"""Verifier plugins for the plugin tests, named in configs as ``tests.unit.rewards.plugin_helpers:NAME`` (imported by the
spawned workers, so they live in a module)."""

import os
import signal
import time


def exact_word(response, reference):
    """1.0 when the response's last word is the reference word, case aside."""
    words = response.split()
    return 1.0 if words and words[-1].lower() == str(reference).lower() else 0.0


def hang(response, reference):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # nothing but the pool's SIGKILL can stop it
    time.sleep(3600)
    return 1.0


def abort(response, reference):
    os.abort()  # SIGABRT: the worker dies as after a segfault in a verifier's C extension


def raises(response, reference):
    raise KeyError(f"plugin bug on {response!r}")


def out_of_range(response, reference):
    return 2.0


def one_argument(response):
    return 1.0


NOT_A_FUNCTION = 3
