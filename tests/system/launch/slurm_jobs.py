"""Helpers of the local-Slurm tests: submit a launch script, find its Slurm job, watch it, act on it, and check that
nothing of it is left.

Every job of a test runs under that test's own NEMORUN_HOME, whose path is in every process of the job (the shipped
config, the output directory), so `job_processes(home)` finds exactly the job's processes on this shared machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PY = sys.executable

# The demo recipe, tiny: 4 steps of 4 prompts (x 8 answers), a checkpoint every 2 steps.
TRAIN_STEPS = 4
TRAIN_OVERRIDES = [
    f"trainer.steps={TRAIN_STEPS}",
    "checkpoint.save_every=2",
    "trainer.prompts_per_step=4",
    "trainer.eval_every=0",
    "trainer.tensorboard=false",
    "trainer.save_hf=false",
]
METRIC_KEYS = ("reward/mean", "actor/loss", "actor/grad_norm", "loss/entropy", "loss/rank1_prob")


def launch_command(script: str, args: list[str]) -> list[str]:
    return [PY, str(REPO / "launch" / script), "--executor", "slurm_local", *args]


def launch_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "MEGATRON_RLVR_"))}
    home.mkdir(parents=True, exist_ok=True)
    return {**env, "NEMORUN_HOME": str(home), "OMP_NUM_THREADS": "1", **(extra or {})}


def run_launch(script: str, args: list[str], home: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        launch_command(script, args), capture_output=True, text=True, env=launch_env(home), timeout=timeout, cwd=home
    )


def start_launch(script: str, args: list[str], home: Path) -> subprocess.Popen:
    env = launch_env(home)  # makes `home`
    with open(home / "launch.log", "w") as log:  # the launcher writes to its own copy of the descriptor
        return subprocess.Popen(
            launch_command(script, args), stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=home
        )


class BackgroundLaunch:
    """A launch started now and waited for when a test reads its outcome: the local cluster runs two jobs at once
    (each takes one of a node's two CPUs), so an uninterrupted run goes beside the scenario compared with it."""

    def __init__(self, script: str, args: list[str], home: Path) -> None:
        self.home = home
        self.started = time.monotonic()
        self.proc = start_launch(script, args, home)
        self.seconds: float | None = None  # from the start to the launcher's end, not to when a test read it
        self._watch = threading.Thread(target=self._time_the_end, daemon=True)
        self._watch.start()

    def _time_the_end(self) -> None:
        self.proc.wait()
        self.seconds = time.monotonic() - self.started

    def wait(self, timeout: float) -> int:
        """The launcher's exit status; AssertionError (with its log) when it did not end within `timeout` of its
        start."""
        self._watch.join(timeout=max(1.0, timeout - (time.monotonic() - self.started)))
        if self._watch.is_alive():
            raise AssertionError(
                f"the launch under {self.home} did not end within {timeout:.0f} s:\n{launch_log(self.home)[-3000:]}"
            )
        return self.proc.returncode

    def stop(self) -> None:
        """Teardown: the launcher and whatever it submitted."""
        stop_launch(self.proc)
        cancel_jobs(self.home)


class InBackground:
    """A scenario's driver (its waits and its kills) run in a thread of its own from now, so its job can go beside
    others; `outcome` waits for it and returns what it returned, or raises what it raised."""

    def __init__(self, drive) -> None:
        self._drive = drive
        self._result = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._drive()
        except BaseException as e:  # noqa: BLE001  # handed to the test that reads the outcome
            self._error = e

    def outcome(self, timeout: float):
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the scenario did not end within {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        return self._result


def launch_log(home: Path) -> str:
    path = home / "launch.log"
    return path.read_text() if path.is_file() else ""


def slurm(*args: str, check: bool = True) -> str:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check and out.returncode:
        raise AssertionError(f"{' '.join(args)}: {out.stderr}")
    return out.stdout


def job_ids(home: Path) -> list[int]:
    """The Slurm jobs submitted under `home`, or under a NEMORUN_HOME inside it (from the batch output files nemo-run
    names by job id)."""
    ids = {
        int(m.group(1))
        for p in home.glob("**/experiments/*/*/*/sbatch_*.out")
        if (m := re.search(r"_(\d+)\.out$", p.name))
    }
    return sorted(ids)


def wait_for_job(home: Path, proc: subprocess.Popen, timeout: float = 600) -> int:
    """The job the launch `proc` submitted under `home`, once it runs. The timeout covers a wait in the queue: the
    cluster runs two jobs at once, and a selection of the tests may leave a background run going beside this one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = job_ids(home)
        if ids:
            return ids[-1]
        if proc.poll() is not None:
            raise AssertionError(
                f"the launch ended (status {proc.returncode}) before its job ran:\n{launch_log(home)[-3000:]}"
            )
        time.sleep(0.5)
    raise AssertionError(f"no Slurm job under {home} after {timeout:.0f} s:\n{launch_log(home)[-3000:]}")


def job_runs(job: int) -> list[tuple[str, str]]:
    """(state, exit code) of every run of `job`, the requeued ones first (`sacct -D`: duplicates)."""
    lines = slurm("sacct", "-D", "-X", "-n", "-P", "-o", "State,ExitCode", "-j", str(job)).splitlines()
    runs = [line.split("|") for line in lines if line.strip()]
    return [(state.split()[0], code) for state, code in runs]  # "CANCELLED by 0": the state alone


def task_logs(home: Path) -> dict[int, str]:
    """The srun task logs by restart count (nemo-run writes `log-<name>_<job>_<restart>.out`)."""
    logs = {}
    for p in home.glob("experiments/*/*/*/log-*.out"):
        m = re.search(r"_(\d+)_(\d+)\.out$", p.name)
        if m:
            logs[int(m.group(2))] = p.read_text(errors="replace")
    return logs


def metrics(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def logged_steps(out_dir: Path) -> int:
    path = out_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, home: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"the launch ended (status {proc.returncode}) before {what}:\n"
                f"{launch_log(home)[-4000:] if home else ''}"
            )
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def assert_metrics_equal(reference: list[dict], resumed: list[dict]) -> None:
    """Step by step, within 1e-6 relative (as tools/checks/check_kill_resume.sh), every step exactly once."""
    assert [m["step"] for m in resumed] == [m["step"] for m in reference], [m["step"] for m in resumed]
    for a, b in zip(reference, resumed):
        for key in METRIC_KEYS:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])


# -- processes ----------------------------------------------------------------------------------------------------


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def job_processes(home: Path) -> list[str]:
    """`pid cmdline` of every process on this machine of a job under `home`: its command line names `home` (the
    launcher excluded), or its environment is one of the jobs' (SLURM_JOB_ID; the ranks' verifier workers)."""
    me, jobs = os.getpid(), {str(j) for j in job_ids(home)}
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            cmd = _cmdline(int(entry.name))
            if not cmd or "launch/" in cmd:
                continue
            if str(home) in cmd or _environ(int(entry.name)).get("SLURM_JOB_ID") in jobs:
                found.append(f"{entry.name} {cmd[:200]}")
    return found


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def rank_pid(home: Path, node: str) -> int:
    """The training rank on `node`: the child of that node's torchrun (not a process the rank forked, which has the
    same command line)."""
    pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    agents = {
        pid
        for pid in pids
        if str(home) in (cmd := _cmdline(pid)) and "torchrun" in cmd and _environ(pid).get("SLURMD_NODENAME") == node
    }
    ranks = [pid for pid in pids if _parent(pid) in agents and "megatron_rlvr.cli" in _cmdline(pid)]
    if len(ranks) != 1:
        raise AssertionError(f"expected one rank of the job under {home} on {node}, found {ranks} (torchrun {agents})")
    return ranks[0]


def assert_nothing_left(home: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while job_processes(home) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = job_processes(home)
    assert not left, "processes of the job are left:\n" + "\n".join(left)


def cancel_jobs(home: Path) -> None:
    """Teardown: cancel whatever this test submitted (a failed assertion must not leave a job running)."""
    for job in job_ids(home):
        subprocess.run(["scancel", "--full", "--signal=KILL", str(job)], capture_output=True, timeout=30)
        subprocess.run(["scancel", str(job)], capture_output=True, timeout=30)


def stop_launch(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
