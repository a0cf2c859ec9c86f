"""A stop through the local launcher (runtime/stop_relay.py, in `console.torchrun`): SIGTERM or Ctrl-C reaches the
ranks as their stop request, the launcher waits for the step in flight however long it lasts (torchrun's own grace is
shrunk to 1 s here, and outlasted), then exits 0 with no traceback; a second signal or $MEGATRON_RLVR_STOP_TIMEOUT
stops the ranks at once, their own processes included. The stand-in ranks (tests/support/runtime/stopping_rank.py) import
nothing heavy; the last test is the real thing: the demo recipe's ranks with a slowed step, signalled in that step,
and the rerun of the same command resuming from its checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_rlvr.runtime.stop_relay import StopRelay, forwarding

REPO = Path(__file__).resolve().parents[3]
CONSOLE = [sys.executable, "-m", "megatron_rlvr.runtime.console", "--standalone", "--nproc-per-node", "2"]


class Launched:
    """A launcher started in the background, its output read line by line as it comes (stdout and stderr merged)."""

    def __init__(self, cmd: list[str], env_extra: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env_extra or {})}
        for name in (
            "MEGATRON_RLVR_DEBUG",
            "MEGATRON_RLVR_VERBOSE",
            "MEGATRON_RLVR_LOG_DIR",
            "TORCHELASTIC_ERROR_FILE",
        ):
            env.pop(name, None)
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def seen(self, text: str) -> int:
        # counted within lines, not by line: two ranks printing at once can share one line ("ready 1ready 0")
        return sum(line.count(text) for line in self.lines)

    def wait_for(self, text: str, count: int = 1, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.seen(text) < count and time.monotonic() < deadline:
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        assert self.seen(text) >= count, f"no {count} x {text!r} in:\n" + self.output[-4000:]

    def finish(self, timeout_s: float = 300) -> int:
        try:
            status = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:  # the ranks run in sessions of their own: each goes by its pid
                for process in [*psutil.Process(self.proc.pid).children(recursive=True), self.proc]:
                    with contextlib.suppress(psutil.Error, ProcessLookupError):
                        process.kill()
                self.proc.wait()
        self._reader.join(timeout=10)
        return status

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too, only not yet reaped
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.dist
def test_ctrl_c_reaches_the_ranks_as_a_stop_and_the_launcher_waits_past_torchruns_grace(tmp_path):
    run = Launched(
        [*CONSOLE, "-m", "tests.support.runtime.stopping_rank", str(tmp_path), "finish", "4"],
        {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"},  # torchrun alone would SIGKILL the ranks 1 s after passing it on
    )
    run.wait_for("ready", count=2)
    run.proc.send_signal(signal.SIGINT)
    status = run.finish(timeout_s=120)
    assert status == 0, run.output[-3000:]
    for rank in (0, 1):  # each got one SIGTERM (not Ctrl-C's SIGINT) and finished its step, > 1 s later
        signals, seconds = (tmp_path / f"rank{rank}").read_text().split()
        assert signals == "SIGTERM" and 0 < float(seconds) <= 4.5, (rank, signals, seconds)
    assert [line for line in run.lines if line.startswith("[launch]")] == [
        "[launch] got SIGINT: the ranks finish the current step, write its checkpoint and exit 0 (a second signal "
        "stops them at once, without it)"
    ]
    assert "Traceback" not in run.output and "SignalException" not in run.output


@pytest.mark.dist
def test_the_stop_timeout_stops_stuck_ranks_at_once_with_their_processes(tmp_path):
    run = Launched(
        [*CONSOLE, "-m", "tests.support.runtime.stopping_rank", str(tmp_path), "ignore"],
        {"MEGATRON_RLVR_STOP_TIMEOUT": "1"},
    )
    run.wait_for("ready", count=2)
    run.proc.send_signal(signal.SIGTERM)
    status = run.finish(timeout_s=120)
    assert status == 128 + signal.SIGTERM, run.output[-3000:]
    launch_lines = [line for line in run.lines if line.startswith("[launch]")]
    assert launch_lines[1:] == [
        "[launch] no stop within 1 s: stopping the ranks now, without a checkpoint of the step in flight"
    ], run.output[-3000:]
    assert "$MEGATRON_RLVR_STOP_TIMEOUT" in launch_lines[0]
    children = [int((tmp_path / f"rank{r}.child").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in children), "a rank's own process outlived the forced stop"
    assert "Traceback" not in run.output


def _sleepers(count: int, ignoring_sigterm: bool = False) -> list[subprocess.Popen]:
    code = "import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignoring_sigterm else "")
    procs = [
        subprocess.Popen([sys.executable, "-c", code + "print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
        for _ in range(count)
    ]
    for p in procs:  # set up
        p.stdout.readline()
    return procs


def test_a_repeat_is_the_same_request_and_a_later_signal_forces(capfd):
    sleepers = _sleepers(2)
    pids = [p.pid for p in sleepers]
    try:
        with StopRelay.installed(lambda: [p for p in pids if _alive(p)], same_request_s=0.5) as relay:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)  # delivered twice (Slurm signals every process of a job step)
            time.sleep(0.1)
            assert relay.signum == signal.SIGUSR1 and not relay.forced
            assert all(p.poll() == -signal.SIGUSR1 for p in _waited(sleepers))  # passed on once, as SIGUSR1
        sleepers = _sleepers(2, ignoring_sigterm=True)  # ranks that take a stop and go on
        pids = [p.pid for p in sleepers]
        with StopRelay.installed(lambda: [p for p in pids if _alive(p)], same_request_s=0.2) as relay:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.4)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            assert relay.forced == "second signal (SIGTERM)" and relay.exit_status == 128 + signal.SIGINT
            assert all(p.poll() == -signal.SIGKILL for p in _waited(sleepers))
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
    err = capfd.readouterr().err
    assert err.count("[launch] got ") == 2 and err.count("stopping the ranks now") == 1


def _waited(procs: list[subprocess.Popen]) -> list[subprocess.Popen]:
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    return procs


def test_a_process_that_started_a_launcher_passes_each_signal_on():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            "got = []\n"
            "for s in (signal.SIGTERM, signal.SIGINT): signal.signal(s, lambda n, f: got.append(n))\n"
            "print('ready', flush=True)\n"
            "while len(got) < 2: time.sleep(0.01)\n"
            "print(*got, flush=True)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with forwarding(lambda: [child.pid]) as received:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            out, _ = child.communicate(timeout=30)
        assert received == [signal.SIGINT, signal.SIGTERM]
        assert out.split() == [str(int(signal.SIGINT)), str(int(signal.SIGTERM))]
    finally:
        child.kill()
        child.wait()


TINY_RUN = [
    "configs/demo_cpu.yaml",
    "trainer.steps=2",
    "trainer.prompts_per_step=2",
    "rollout.group_size=2",
    "trainer.eval_every=0",
    "trainer.tensorboard=false",
]


@pytest.mark.dist
@pytest.mark.engine
@pytest.mark.slow
def test_sigterm_to_train_keeps_the_step_that_outlasts_torchruns_grace_and_the_rerun_resumes_it(tmp_path):
    """The issue's case: `megatron-rlvr train --nproc-per-node 2` signalled while a step runs that lasts longer than
    torchrun's grace (a 4 s slower update against 1 s of grace): that step's checkpoint, exit 0, the stop's line
    last; the same command again resumes from it."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rlvr.cli", "train", "--nproc-per-node", "2", *TINY_RUN]
    cmd.append(f"trainer.output_dir={out}")
    run = Launched(
        cmd,
        {
            "PYTHONPATH": str(REPO),
            "MEGATRON_RLVR_CALLBACKS": "tests.system.runtime.slow_step",
            "MEGATRON_RLVR_TEST_STEP_DELAY_S": "4",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1",
        },
    )
    run.wait_for("[test] rank 0: step update", timeout_s=600)  # step 1, in its update
    run.proc.send_signal(signal.SIGTERM)
    status = run.finish(timeout_s=600)
    assert status == 0, run.output[-4000:]
    step = out / "checkpoints" / "step-000001"
    assert step.is_dir() and not (out / "hf").exists(), run.output[-4000:]  # the final export waits for the end
    last = [line for line in run.lines if line.strip()][-1]
    assert last == (
        f"[preempt] SIGTERM (a preemption, the time limit, or a kill): stopped after step 1 with its checkpoint {step}; "
        "rerun the same command to resume"
    ), run.output[-4000:]
    assert "Traceback" not in run.output and "SignalException" not in run.output
    rerun = Launched(cmd)
    assert rerun.finish(timeout_s=600) == 0, rerun.output[-4000:]
    assert f"[checkpoint] resuming from {step}" in rerun.output, rerun.output[-4000:]
    last = [line for line in rerun.lines if line.strip()][-1]
    assert last.startswith("done: 1 step, final reward ") and last.endswith(
        f"; checkpoints {out / 'checkpoints'}, model {out / 'hf'}"
    ), rerun.output[-4000:]
