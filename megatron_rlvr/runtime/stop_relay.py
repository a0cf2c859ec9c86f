"""A launcher's side of a stop (runtime/preemption.py is the ranks' side): the process that started the ranks passes
SIGTERM, SIGINT and SIGUSR1 on to them and waits while they finish the step in flight, write its checkpoint and exit
0, however long that step takes.

torchrun's agent alone does not: it turns the signal into an exception, sends the ranks that same signal (SIGINT
included, which a rank takes as Ctrl-C, not as a stop), kills them after its shutdown grace (30 s by default) and
exits 1 with a traceback. `console.torchrun` installs a `StopRelay` for these signals in place of the agent's
handlers:

- the first signal goes on to every rank, SIGINT as SIGTERM (the ranks' stop request); a repeat within
  `SAME_REQUEST_S` is the same request delivered twice (Slurm signals every process of a job step);
- a second signal later, or ``$MEGATRON_RLVR_STOP_TIMEOUT`` seconds after the first (unset or 0: no limit), stops
  the ranks at once, without a checkpoint of that step: SIGKILL to each rank's process group (torchrun starts every
  rank in a session of its own, so the rank's engine and verifier processes go with it);
- a signal while no rank runs yet raises `StoppedBeforeStart` where the launcher is.

`forwarding` is what a process that started a launcher does (the demo, a nemo-run local job): every such signal goes
on to the launcher, which decides, and this process waits for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from megatron_rlvr.runtime.preemption import SAME_REQUEST_S

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# what a rank is sent for each: SIGINT would be Ctrl-C there (an exception mid-step), SIGTERM is the stop request
TO_RANKS = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGTERM, signal.SIGUSR1: signal.SIGUSR1}
TIMEOUT_ENV = "MEGATRON_RLVR_STOP_TIMEOUT"


class StoppedBeforeStart(Exception):
    """A stop signal reached the launcher while none of its ranks ran yet: nothing to wait for."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} before any rank started")
        self.signum = signum


def stop_timeout() -> float | None:
    """Seconds the ranks get to stop after the first signal ($MEGATRON_RLVR_STOP_TIMEOUT); None: as long as it takes."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        from megatron_rlvr.errors import UserError

        raise UserError(f"${TIMEOUT_ENV}={value!r}: expected seconds (a number; 0 or unset: no limit)") from None
    return seconds if seconds > 0 else None


def child_pids() -> list[int]:
    """This process's living children (torchrun's ranks, a launcher's job)."""
    import psutil

    children = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE:
                children.append(child.pid)
    return children


def _say(message: str) -> None:
    with contextlib.suppress(RuntimeError, OSError):  # stderr mid-write in the interrupted code
        print(f"[launch] {message}", file=sys.stderr, flush=True)


class StopRelay:
    """The launcher's record of a stop: `signum` the first request (0: none), `forced` the signal or reason that
    stopped the ranks at once ("" when they were left to finish)."""

    def __init__(
        self,
        ranks: Callable[[], list[int]] = child_pids,
        timeout_s: float | None = None,
        same_request_s: float = SAME_REQUEST_S,
    ) -> None:
        self.ranks, self.timeout_s, self.same_request_s = ranks, timeout_s, same_request_s
        self.signum = 0
        self.forced = ""
        self._first_at = 0.0
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    @classmethod
    @contextlib.contextmanager
    def installed(
        cls, ranks: Callable[[], list[int]] = child_pids, same_request_s: float = SAME_REQUEST_S
    ) -> Iterator[StopRelay]:
        """Handle `STOP_SIGNALS` inside the block (main thread only); the previous handlers come back after it."""
        relay = cls(ranks, stop_timeout(), same_request_s)
        old = {sig: signal.signal(sig, relay._on_signal) for sig in STOP_SIGNALS}
        try:
            yield relay
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            if relay._timer is not None:
                relay._timer.cancel()

    @property
    def exit_status(self) -> int:
        """A forced stop's exit status: 128 + the first signal, as a shell reports a process it ended."""
        return 128 + self.signum

    def _on_signal(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        with self._lock:
            if not self.signum:
                ranks = self.ranks()
                if not ranks:
                    raise StoppedBeforeStart(signum)
                self.signum, self._first_at = signum, now
                name = signal.Signals(signum).name
                limit = f"; after {self.timeout_s:g} s (${TIMEOUT_ENV})" if self.timeout_s else ""
                _say(
                    f"got {name}: the ranks finish the current step, write its checkpoint and exit 0 (a second "
                    f"signal{limit} stops them at once, without it)"
                )
                self._send(ranks, TO_RANKS[signal.Signals(signum)])
                if self.timeout_s:
                    self._timer = threading.Timer(
                        self.timeout_s, self._force, (f"no stop within {self.timeout_s:g} s",)
                    )
                    self._timer.daemon = True
                    self._timer.start()
                return
            if self.forced or now - self._first_at < self.same_request_s:
                return  # already forced, or the same request delivered twice
        self._force(f"second signal ({signal.Signals(signum).name})")

    def _force(self, why: str) -> None:
        with self._lock:
            if self.forced:
                return
            self.forced = why
        _say(f"{why}: stopping the ranks now, without a checkpoint of the step in flight")
        for pid in self.ranks():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                # a rank that leads its own process group takes its children along; else the rank alone
                os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)

    @staticmethod
    def _send(pids: list[int], signum: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


@contextlib.contextmanager
def forwarding(targets: Callable[[], list[int]]) -> Iterator[list[int]]:
    """Inside the block (main thread only), pass every stop signal this process gets on to ``targets()`` (a
    launcher, which decides) instead of acting on it. Yields the list of signals received, in order."""
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        for pid in targets():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    old = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
