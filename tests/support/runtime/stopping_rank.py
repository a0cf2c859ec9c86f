"""A stand-in rank for the stop tests, started by torchrun (no torch import, so it starts in a fraction of a second).

    python -m tests.support.runtime.stopping_rank OUT_DIR finish STEP_S     # a stop lets the step in flight finish
    python -m tests.support.runtime.stopping_rank OUT_DIR ignore            # a stop changes nothing (a stuck rank)

``finish``: like a training rank (runtime/preemption.py), SIGTERM and SIGUSR1 are a request; the rank runs steps of
STEP_S seconds and, after the step in which a request came, writes ``OUT_DIR/rank<R>`` (the signals it got and the
seconds from the first to its exit) and exits 0. SIGINT keeps its default (an exception), as on a real rank.
``ignore``: SIGTERM is ignored, and the rank starts a child of its own (``OUT_DIR/rank<R>.child`` holds its pid), so
a test sees whether a forced stop took the rank's whole process group. Both print ``ready <R>`` once set up, and
write ``OUT_DIR/rank<R>.ready``.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _ready(out: Path, rank: str) -> None:
    (out / f"rank{rank}.ready").touch()
    print(f"ready {rank}", flush=True)


def main(argv: list[str]) -> int:
    out, mode = Path(argv[0]), argv[1]
    rank = os.environ["RANK"]
    got: list[str] = []
    first = [0.0]

    def request(signum, frame):
        got.append(signal.Signals(signum).name)
        first[0] = first[0] or time.monotonic()

    if mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        (out / f"rank{rank}.child").write_text(str(child.pid))
        _ready(out, rank)
        time.sleep(600)
        return 1
    step_s = float(argv[2])
    signal.signal(signal.SIGTERM, request)
    signal.signal(signal.SIGUSR1, request)
    _ready(out, rank)
    while True:
        end = time.monotonic() + step_s  # one step: a sleep a signal cannot shorten
        while time.monotonic() < end:
            time.sleep(end - time.monotonic())
        if got:
            (out / f"rank{rank}").write_text(f"{','.join(got)} {time.monotonic() - first[0]:.2f}\n")
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
