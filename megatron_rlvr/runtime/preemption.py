"""Stop a run cleanly when the cluster asks: on SIGTERM or SIGUSR1 every rank finishes its current step, the run
writes a checkpoint and exits 0; a second signal exits at once.

The loop uses it in a few lines::

    with Preemption.installed() as preemption:
        for step in ...:
            ...  # one training step
            if preemption.requested():  # a collective: every rank stops after the same step
                checkpoint.save(...)
                break

How the signal reaches the ranks: Slurm's ``--signal=USR1@300`` (what the Slurm executor asks for) signals every
process of the job step, torchrun included, and torchrun forwards the signals it handles to its workers, so a rank
may get the same request twice within milliseconds; repeats within ``same_request_s`` count as one. A signal after
that is a second request: the process exits at once (exit status 128 + the signal), from a watcher thread, so even
a rank blocked in a collective goes. SIGINT (Ctrl-C) keeps its usual meaning. On one machine the ranks' launcher
(`megatron-rlvr train --nproc-per-node N`) takes the signals in torchrun's place and passes them on, Ctrl-C as
SIGTERM, then waits for the checkpoint however long the step takes (runtime/stop_relay.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SAME_REQUEST_S = 5.0
_WHY = {
    signal.SIGTERM: "a preemption, the time limit, or a kill",
    signal.SIGUSR1: "the warning Slurm sends before the time limit (--signal)",
}


def describe(signum: int) -> str:
    sig = signal.Signals(signum)
    return f"{sig.name} ({_WHY[sig]})" if sig in _WHY else sig.name


STOP_MARKER_ENV = "MEGATRON_RLVR_STOP_MARKER"


def _leave_stop_marker(signum: int) -> None:
    """Rank 0 writes the signal's name to $MEGATRON_RLVR_STOP_MARKER, when set: a Slurm job script (launch/) reads
    it to requeue the job, since torchrun's exit status (1 after forwarding a signal) cannot tell a clean stop."""
    path = os.environ.get(STOP_MARKER_ENV)
    if path and (not dist.is_initialized() or dist.get_rank() == 0):
        with open(path, "w") as f:
            f.write(signal.Signals(signum).name + "\n")


class Preemption:
    """This process's record of stop requests; `requested` is where the ranks agree on one."""

    def __init__(self, signals: Sequence[int] = SIGNALS, same_request_s: float = SAME_REQUEST_S) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.same_request_s = same_request_s
        self.signum = 0  # the first request this process received (0: none)
        self.agreed = 0  # the request the ranks agreed on in `requested` (0: none yet)
        self._first_at = 0.0
        self._lock = threading.Lock()
        self._old_handlers: dict[int, object] = {}
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None

    # -- installing --------------------------------------------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def installed(
        cls, signals: Sequence[int] = SIGNALS, same_request_s: float = SAME_REQUEST_S
    ) -> Iterator[Preemption]:
        """Handle ``signals`` inside the block; the previous handlers come back after it. Outside the main thread
        (where Python cannot handle signals) nothing is installed and `requested` stays False."""
        handler = cls(signals, same_request_s)
        if threading.current_thread() is not threading.main_thread():
            print("[preempt] not on the main thread: SIGTERM/SIGUSR1 keep their default action", file=sys.stderr)
            yield handler
            return
        handler._install()
        try:
            yield handler
        finally:
            handler._uninstall()

    def _install(self) -> None:
        for sig in self.signals:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        # Python runs a handler between bytecodes of the main thread, which may sit in a collective for long; its
        # C-level handler writes the signal number to a wakeup fd at once, and a thread reading it acts on time.
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        old = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if old != -1:  # someone else (an asyncio loop) owns the wakeup fd: leave it, handle in Python only
            signal.set_wakeup_fd(old)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._pipe = (read_fd, write_fd)
        self._watcher = threading.Thread(target=self._watch, args=(read_fd,), name="preemption-watcher", daemon=True)
        self._watcher.start()

    def _uninstall(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(-1)  # it was unset when we took it
            os.close(self._pipe[1])  # the watcher reads EOF and ends
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            os.close(self._pipe[0])
            self._pipe = self._watcher = None

    # -- receiving ---------------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._watcher is None:  # no watcher thread: the handler decides, as soon as Python lets it run
            self._note(signum, may_exit=True)
        else:  # the watcher already acted on this delivery; make sure the request is recorded
            self._note(signum, may_exit=False)

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self.signals:
                    self._note(signum, may_exit=True)

    def _note(self, signum: int, may_exit: bool) -> None:
        now = time.monotonic()
        with self._lock:
            if not self.signum:
                self.signum, self._first_at = signum, now
                self._say(
                    f"got {describe(signum)}: finishing the current step, then a checkpoint and exit 0 "
                    "(a second signal exits at once)"
                )
                return
            if not may_exit or now - self._first_at < self.same_request_s:
                return  # the same request delivered twice (by Slurm and by torchrun)
        self._say(f"second signal ({signal.Signals(signum).name}): exiting now, without a checkpoint")
        os._exit(128 + signum)

    @staticmethod
    def _say(message: str) -> None:
        rank = os.environ.get("RANK", "0")
        try:
            print(f"[preempt] rank {rank}: {message}", file=sys.stderr, flush=True)
        except RuntimeError:  # stderr was mid-write in the interrupted code: the request still counts
            pass

    # -- agreeing ----------------------------------------------------------------------------------------------

    def requested(self) -> bool:
        """Whether any rank received a stop request (a collective over the default group: every rank calls it at
        the same point, so every rank stops after the same step)."""
        local = self.signum
        if dist.is_initialized():
            flag = torch.tensor([local], dtype=torch.int64)  # CPU: gloo's half of distributed.backend() carries it
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = int(flag)
        if local and not self.agreed:
            self.agreed = local
            _leave_stop_marker(local)
        return bool(local)

    @property
    def reason(self) -> str:
        """What stopped the run, for the log (after `requested` returned True)."""
        return describe(self.agreed) if self.agreed else "no stop request"
