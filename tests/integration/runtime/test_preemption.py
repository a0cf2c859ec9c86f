"""SIGTERM / SIGUSR1 stop a run cleanly: the request is recorded, the ranks agree on it at the step's end, the same
request delivered twice (Slurm and torchrun) counts once, and a later second signal exits at once even while the
main thread is busy. Through the trainer (a run signalled mid-step writes its checkpoint, returns, and the rerun
continues exactly like an uninterrupted run) it is the "preempted" row of tests/integration/test_resume.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_rlvr.runtime.preemption import Preemption

REPO = Path(__file__).resolve().parents[3]


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_a_signal_is_a_request_and_the_old_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    with Preemption.installed() as preemption:
        assert not preemption.requested() and preemption.reason == "no stop request"
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: preemption.signum == signal.SIGUSR1)
        assert preemption.requested() and preemption.reason.startswith("SIGUSR1 (the warning Slurm sends")
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd was handed back too


_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from megatron_rlvr.runtime.preemption import Preemption

    with Preemption.installed(same_request_s=0.5) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # within same_request_s: the same request, delivered twice
        time.sleep(0.2)
        print("requested", preemption.requested(), preemption.reason.split()[0], flush=True)
        time.sleep(0.5)
        print("ready", flush=True)
        time.sleep(60)  # "a step": the second signal must not wait for it
        print("still running", flush=True)
""")


def test_a_repeat_counts_once_and_a_later_second_signal_exits_at_once():
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert child.stdout.readline().split() == ["requested", "True", "SIGUSR1"]
        assert child.stdout.readline().strip() == "ready"
        start = time.monotonic()
        child.send_signal(signal.SIGTERM)
        rc = child.wait(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        child.kill()
        child.wait()
    err = child.stderr.read()
    assert rc == 128 + signal.SIGTERM and elapsed < 10, (rc, elapsed, err)
    assert err.count("got SIGUSR1") == 1 and "second signal (SIGTERM): exiting now, without a checkpoint" in err
    assert "still running" not in child.stdout.read()


def _agree(signalled_rank: int):
    import torch.distributed as dist

    with Preemption.installed() as preemption:
        before = preemption.requested()
        if dist.get_rank() == signalled_rank:
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for(lambda: preemption.signum)
        after = preemption.requested()
        return before, after, preemption.signum, preemption.reason


@pytest.mark.dist
def test_every_rank_agrees_when_one_rank_was_signalled(workers2):
    results = workers2.run(_agree, 1)
    assert [r[:3] for r in results] == [(False, True, 0), (False, True, signal.SIGTERM)]
    assert all(r[3].startswith("SIGTERM (a preemption") for r in results)
