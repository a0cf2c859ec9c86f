"""Fully asynchronous training across the local Slurm cluster's two nodes (tools/env/slurm_cluster.sh): the actor rank on
one node, the engine rank on the other, ``rollout.max_staleness=2``, answers made long-tailed
(megatron_rlvr/testing/long_tail) so that responses are in flight at every weight update. `scancel --signal=USR1
--full` after the first logged step: the ranks finish their step and checkpoint it with the stream's state
(finished groups, every response in flight with its tokens and weight versions), the job requeues itself, and the
rerun resumes from that checkpoint and continues those responses. What holds is docs/async.md's guarantee: every step
once, the bound on every step, nothing dropped, saved responses continued from their tokens and trained (not the
uninterrupted run's metrics: timing decides which version samples which token).

It uses the cluster fixture (conftest.py) and the job helpers (slurm_jobs.py) of the other scenarios, and could join
a shared set-up as one more scenario: it needs only a NEMORUN_HOME of its own and the job's output directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.system.launch.slurm_jobs import (
    REPO,
    TRAIN_OVERRIDES,
    TRAIN_STEPS,
    assert_nothing_left,
    cancel_jobs,
    job_runs,
    launch_log,
    logged_steps,
    metrics,
    slurm,
    start_launch,
    stop_launch,
    task_logs,
    wait_for_job,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

K = 2
HOOK = REPO / "megatron_rlvr" / "testing" / "long_tail"
JOB_TIMEOUT_S = 900


@pytest.fixture
def async_home(tmp_path, slurm_cluster):
    """This test's NEMORUN_HOME; at teardown its jobs are cancelled and none of their processes may be left."""
    yield tmp_path
    cancel_jobs(tmp_path)
    assert_nothing_left(tmp_path)


def _args(home: Path) -> list[str]:
    return [
        "--recipe",
        "demo_cpu",
        "--nodes",
        "2",
        "--time",
        "00:30:00",
        "--signal",
        "USR1@600",  # the lead time covers one step and its checkpoint on a loaded machine (docs/slurm-local.md)
        "--env",
        f"PYTHONPATH={REPO}:{HOOK}",
        "--env",
        "MEGATRON_RLVR_LONG_TAIL=40,0.6,0.05",  # a forced slow engine: responses in flight at every update
        "rollout.placement=separate",
        "rollout.engine_ranks=1",
        "actor.tp=1",
        f"rollout.max_staleness={K}",
        "rollout.max_new_tokens=96",
        "algo.rollout_correction.kind=tis",
        *TRAIN_OVERRIDES,
        f"trainer.output_dir={home}/out",
    ]


@pytest.mark.timeout(1800)
def test_async_two_nodes_usr1_requeue_resumes_the_stream(async_home):
    import torch

    home = async_home
    launch = start_launch("train.py", _args(home), home)
    try:
        job = wait_for_job(home, launch)
        wait_until(lambda: logged_steps(home / "out") >= 1, 600, "the first logged step", launch, home)
        slurm("scancel", "--signal=USR1", "--full", str(job))
        t_signal = time.monotonic()
        launch.wait(timeout=JOB_TIMEOUT_S)
    finally:
        stop_launch(launch)
    assert launch.returncode == 0, launch_log(home)[-4000:]
    assert job_runs(job) == [("REQUEUED", "0:0"), ("COMPLETED", "0:0")], job_runs(job)
    logs = task_logs(home)
    stopped = [line for line in logs[0].splitlines() if "stopped after step" in line]
    assert stopped, logs[0][-3000:]
    step = int(stopped[0].split("stopped after step ")[1].split()[0])
    ckpt = home / "out" / "checkpoints" / f"step-{step:06d}"
    assert f"[checkpoint] resuming from {ckpt}" in logs[1], logs[1][-3000:]
    state = torch.load(ckpt / "pending_rollout.pt", weights_only=False)

    def partial_responses(flights) -> int:
        return sum(len(r.token_ids) > 0 and not r.finish_reason for f in flights for r in f.responses)

    # the rerun continues the groups the saved ledger holds unfinished. Ledger steps count from 0 (the log's "step
    # s" is ledger step s - 1): a group due by the last one, TRAIN_STEPS - 1, must train; one due later trains only
    # if it finishes early enough, and may still be in flight when the run ends
    unfinished = {e.index: e for e in state.entries if not e.finished}
    flights = [f for f in state.in_flight if f.entry.index in unfinished]
    partial = partial_responses(flights)
    due = partial_responses([f for f in flights if unfinished[f.entry.index].deadline <= TRAIN_STEPS - 1])
    assert state.taken.step == step and state.next_step == step + 1 and due > 0  # step `step` shipped before it

    rows = metrics(home / "out")
    assert [r["step"] for r in rows] == list(range(1, TRAIN_STEPS + 1))
    for r in rows:
        assert r["rollout/staleness_max"] <= K and r["async/dropped"] == 0, r
    resumed = sum(r["async/resumed_responses"] for r in rows[step:])
    # continued from their saved tokens and trained, each at most once; every one due within the run among them
    assert due <= resumed <= partial, (due, resumed, partial)
    print(
        f"stopped after step {step} with {partial} responses in flight ({due} due within the run); requeued, resumed, "
        f"and {resumed} of them continued and trained, done {time.monotonic() - t_signal:.0f} s after the signal"
    )
    assert_nothing_left(home)
