"""Picklable scorers for the pool tests (imported by spawned workers, so they live in a module, not a test)."""

import os
import signal
import time


def hang(response, reference):
    """Blocks in a way no signal.alarm can interrupt: the pool's wall timeout must kill the worker."""
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(3600)
    return 1.0


def die(response, reference):
    """The worker process vanishes mid-item (as after a segfault or the OOM killer)."""
    os._exit(1)


def boom(response, reference):
    raise RuntimeError("verifier bug")


def echo(response, reference):
    return 1.0 if response == reference else 0.0


def refuse(response, reference):
    """What the code verifier raises where the sandbox can isolate nothing and rlimits-only was not accepted."""
    from megatron_rlvr.rewards.sandbox import SandboxUnavailableError

    raise SandboxUnavailableError("code sandbox: no isolation can be had here: (as in a test)")
